#!/usr/bin/env bash
# Find or build a QEMU that has vfio-user-pci (QEMU >= 10.1), and get a Debian guest kernel
# and busybox for the real-VMM suite. Never touches the system's QEMU or its apt sources.
#
#   scripts/qemu.sh qemu     print the path of a usable qemu-system-x86_64 (building it if needed)
#   scripts/qemu.sh guest    print the directory holding vmlinuz, busybox and the kernel modules
#   scripts/qemu.sh env      both, as shell assignments (QEMU_BIN=..., UMDEV_GUEST_DIR=...),
#                            and QEMU_FIRMWARE='-L dir ...' (see firmware)
#   scripts/qemu.sh firmware print the -L firmware flags a QEMU built here needs on its command
#                            line (it is built without its own BIOS blobs and reads Debian's
#                            seabios, ipxe-qemu and qemu-system-data); nothing is built
#
# Lookup order for QEMU: $QEMU_BIN, then qemu-system-x86_64 on PATH, then the cache
# ($UMDEV_CACHE_DIR, default ~/.cache/umdev). A candidate is used only if it is >= 10.1 and
# lists vfio-user-pci. Otherwise QEMU 10.2.2 is built into the cache from Debian's source
# package (about 15 minutes on 2 cores, once per machine). Progress goes to stderr; only the
# answer goes to stdout.
#
# The build carries one upstream fix that 10.2.2 lacks: "vfio-user: Do not delete the
# subregion" (qemu-devel, October 2025), which stops vfio_user_msix_teardown() in
# hw/vfio-user/pci.c from deleting the MSI-X PBA subregion a second time. Without it QEMU
# aborts (memory_region_del_subregion: Assertion 'subregion->container == mr') when it frees
# an unplugged vfio-user-pci device that has MSI-X, which is what every hot-unplug of an
# umdev device leads to (`device_del`; 10.2.2's vfio-user-pci does not answer the request
# IRQ of `umdev remove` itself). The build is cached as qemu-10.2.2+unplug-fix (a stock build in
# qemu-10.2.2 is never taken for it) and its version string carries the marker
# "umdev-unplug-fix" (`qemu-system-x86_64 --version`), by which umdev-vmtest tells that the
# `unplug` guest run can use it. The whole suite uses this one build: the fix only changes
# the freeing of an unplugged device, which no other guest run does, and a second (stock)
# build would add ~15 minutes to a fresh machine's first run for no coverage. A QEMU from
# $QEMU_BIN or PATH is used as it is: without the marker the `unplug` run is skipped with a
# message (UMDEV_QEMU_UNPLUG_FIX=1 declares a QEMU that has the fix).
set -euo pipefail

QEMU_DEB_VERSION="1:10.2.2+ds-1"
QEMU_VERSION="10.2.2"
CACHE="${UMDEV_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/umdev}"
# The fix carried by the build and its marker in the version string (see the header; the
# marker is also in vmtest/src/qemu_unplug.rs).
QEMU_FIX="unplug-fix"
QEMU_PKGVERSION="umdev-$QEMU_FIX"
QEMU_PREFIX="$CACHE/qemu-$QEMU_VERSION+$QEMU_FIX"
GUEST_DIR="$CACHE/guest"
# Modules beyond the first runs' (uio_pci_generic, VFIO): what the NVMe runs load (the stock
# driver, and ext4 with crc32c for the file system) and what the virtio-gpu run loads
# (virtio_pci and virtio_gpu, with their drm dependencies). A guest directory unpacked
# before one of them was listed gets it added (add_guest_modules).
GUEST_EXTRA_MODULES="nvme ext4 crc32c_generic virtio_pci virtio_gpu"

say() { printf 'qemu.sh: %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }

# Is "$1" a qemu-system-x86_64 >= 10.1 with vfio-user-pci?
usable_qemu() {
    local bin="$1" ver major minor
    [ -x "$bin" ] || return 1
    ver=$("$bin" --version 2>/dev/null | sed -n 's/^QEMU emulator version \([0-9]*\)\.\([0-9]*\).*/\1 \2/p') || return 1
    [ -n "$ver" ] || return 1
    read -r major minor <<<"$ver"
    if [ "$major" -lt 10 ] || { [ "$major" -eq 10 ] && [ "$minor" -lt 1 ]; }; then
        say "$bin is QEMU $major.$minor (< 10.1, no vfio-user-pci): not used"
        return 1
    fi
    if ! "$bin" -nodefaults -machine none -device help 2>/dev/null | grep -q '"vfio-user-pci"'; then
        say "$bin is QEMU $major.$minor but was built without vfio-user-pci: not used"
        return 1
    fi
    return 0
}

# Is the cached build there, usable, and the one with the fix (its version string has the
# marker)?
cached_qemu_ok() {
    local bin="$QEMU_PREFIX/bin/qemu-system-x86_64"
    usable_qemu "$bin" || return 1
    if ! "$bin" --version 2>/dev/null | head -n1 | grep -qF "($QEMU_PKGVERSION)"; then
        say "$bin has no '$QEMU_PKGVERSION' marker in its version: not used (it is rebuilt)"
        return 1
    fi
}

need_root_for_packages() {
    if [ "$(id -u)" -ne 0 ]; then
        die "installing build dependencies needs root (apt-get); install: $*"
    fi
}

apt_install() {
    local missing=()
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
    done
    [ "${#missing[@]}" -eq 0 ] && return 0
    need_root_for_packages "${missing[@]}"
    say "installing from Debian stable: ${missing[*]}"
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
}

# The archive the machine already uses (deb.debian.org, a mirror, a snapshot...).
debian_archive() {
    local uri
    uri=$(grep -hE '^\s*URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}' | grep -v -- '-security' | grep -i debian | head -n1 || true)
    if [ -z "$uri" ]; then
        uri=$(grep -hE '^\s*deb\s' /etc/apt/sources.list 2>/dev/null | awk '{for(i=2;i<=NF;i++) if ($i ~ /^[a-z]+:\/\//) {print $i; exit}}' | grep -v -- '-security' | head -n1 || true)
    fi
    [ -n "$uri" ] || die "cannot find a Debian archive in /etc/apt/sources.list*"
    printf '%s\n' "$uri"
}

# The upstream fix "vfio-user: Do not delete the subregion" (qemu-devel, 2025-10-10,
# Message-Id 20251010-vfio-v1-1-d7a6056539b7@rsg.ci.i.u-tokyo.ac.jp): vfio_user_msix_teardown()
# runs from instance_finalize, when the PBA subregion has already been finalized, and its
# memory_region_del_subregion() call trips an assertion. The patch deletes that call and the
# lines that only fed it (the two locals, their assignments and a blank line), nothing else.
# The function is checked before and after against its expected text, so a source that
# differs in any way (another QEMU version, the fix already in) stops the build here.
apply_unplug_fix() {
    local file="$1/hw/vfio-user/pci.c" fn='/^static void vfio_user_msix_teardown(/,/^}/'
    [ -f "$file" ] || die "unplug fix: $file not found"
    local before after
    before=$(sed -n "${fn}p" "$file")
    local want_before='static void vfio_user_msix_teardown(VFIOPCIDevice *vdev)
{
    MemoryRegion *mr, *sub;

    mr = vdev->bars[vdev->msix->pba_bar].mr;
    sub = vdev->msix->pba_region;
    memory_region_del_subregion(mr, sub);

    g_free(vdev->msix->pba_region);
    vdev->msix->pba_region = NULL;
}'
    local want_after='static void vfio_user_msix_teardown(VFIOPCIDevice *vdev)
{
    g_free(vdev->msix->pba_region);
    vdev->msix->pba_region = NULL;
}'
    if [ "$before" != "$want_before" ]; then
        printf '%s\n' "$before" >&2
        die "unplug fix: vfio_user_msix_teardown() in $file is not the expected 10.2.2 text (above)"
    fi
    [ "$(grep -c 'memory_region_del_subregion(mr, sub);' "$file")" -eq 1 ] ||
        die "unplug fix: 'memory_region_del_subregion(mr, sub);' is not in $file exactly once"
    sed -i "${fn}{/^    MemoryRegion \*mr, \*sub;\$/,/^    memory_region_del_subregion(mr, sub);\$/d}" "$file"
    sed -i "${fn}{/^{\$/{n;/^\$/d}}" "$file"
    after=$(sed -n "${fn}p" "$file")
    if [ "$after" != "$want_after" ]; then
        printf '%s\n' "$after" >&2
        die "unplug fix: vfio_user_msix_teardown() after the edit is not the expected text (above)"
    fi
    [ "$(grep -c 'memory_region_del_subregion(mr, sub);' "$file")" -eq 0 ] ||
        die "unplug fix: the call is still in $file"
    say "applied the upstream fix 'vfio-user: Do not delete the subregion' to $file"
}

build_qemu() {
    local work="$CACHE/build-qemu-$QEMU_FIX"
    say "no usable QEMU found: building QEMU $QEMU_VERSION with the vfio-user unplug fix from Debian's source package into $QEMU_PREFIX"
    say "(about 15 minutes on 2 cores; done once per machine)"
    apt_install dpkg-dev ninja-build pkg-config libglib2.0-dev libpixman-1-dev flex bison gcc make \
        python3-venv seabios ipxe-qemu qemu-system-data
    rm -rf "$work"
    mkdir -p "$work/apt/lists/partial" "$work/apt/cache/archives/partial"
    # A private apt configuration holding only unstable's *source* index: the system's apt
    # sources and state are not changed, and no binary package from unstable is installed.
    local archive
    archive=$(debian_archive)
    printf 'deb-src %s unstable main\n' "$archive" >"$work/apt/sources.list"
    local aptopts=(-o "Dir::Etc::SourceList=$work/apt/sources.list" -o "Dir::Etc::SourceParts=-"
        -o "Dir::State::Lists=$work/apt/lists" -o "Dir::Cache=$work/apt/cache" -o "APT::Sandbox::User=root")
    say "fetching unstable's source index from $archive"
    apt-get "${aptopts[@]}" update -q >&2
    say "downloading qemu=$QEMU_DEB_VERSION source"
    (cd "$work" && apt-get "${aptopts[@]}" source -q "qemu=$QEMU_DEB_VERSION" >&2)
    local src
    src=$(find "$work" -maxdepth 1 -type d -name "qemu-$QEMU_VERSION*" | head -n1)
    [ -d "$src" ] || die "apt-get source did not unpack qemu-$QEMU_VERSION"
    apply_unplug_fix "$src"
    say "installing meson from PyPI into a venv (Debian stable's meson is too old)"
    python3 -m venv "$work/venv" >&2
    "$work/venv/bin/pip" install -q 'meson>=1.5' >&2
    say "configuring"
    mkdir -p "$src/build"
    (cd "$src/build" && PATH="$work/venv/bin:$PATH" ../configure --prefix="$QEMU_PREFIX" \
        --python="$work/venv/bin/python3" \
        --target-list=x86_64-softmmu --disable-docs --disable-werror --disable-download \
        --disable-install-blobs --disable-gtk --disable-sdl --disable-opengl --disable-tools \
        --disable-guest-agent --disable-rust --disable-xen --disable-spice \
        --with-pkgversion="$QEMU_PKGVERSION" >&2)
    say "building (ninja -j$(nproc))"
    (cd "$src/build" && PATH="$work/venv/bin:$PATH" ninja -j"$(nproc)" qemu-system-x86_64 >&2)
    rm -rf "$QEMU_PREFIX"
    mkdir -p "$QEMU_PREFIX/bin"
    cp "$src/build/qemu-system-x86_64" "$QEMU_PREFIX/bin/"
    rm -rf "$work"
    cached_qemu_ok || die "the freshly built QEMU is not usable or lacks the '$QEMU_PKGVERSION' marker"
    say "built $QEMU_PREFIX/bin/qemu-system-x86_64"
}

# Firmware QEMU loads at run time (the QEMU built here is configured without its own blobs).
ensure_firmware() {
    apt_install seabios ipxe-qemu qemu-system-data
}

# Where those packages put the firmware; the same list as FIRMWARE_DIRS in vmtest/src/qemu.rs.
FIRMWARE_DIRS=(/usr/share/seabios /usr/share/qemu /usr/lib/ipxe/qemu)

# The -L flags for the firmware directories that exist, on one line.
firmware_flags() {
    local d flags=()
    for d in "${FIRMWARE_DIRS[@]}"; do
        [ -d "$d" ] && flags+=(-L "$d")
    done
    [ "${#flags[@]}" -gt 0 ] || say "no firmware directory found (${FIRMWARE_DIRS[*]}): install seabios ipxe-qemu qemu-system-data"
    printf '%s\n' "${flags[*]}"
}

find_qemu() {
    if [ -n "${QEMU_BIN:-}" ]; then
        usable_qemu "$QEMU_BIN" && { printf '%s\n' "$QEMU_BIN"; return; }
        die "\$QEMU_BIN=$QEMU_BIN is not a usable QEMU (needs >= 10.1 with vfio-user-pci)"
    fi
    local onpath
    onpath=$(command -v qemu-system-x86_64 || true)
    if [ -n "$onpath" ] && usable_qemu "$onpath"; then printf '%s\n' "$onpath"; return; fi
    if cached_qemu_ok 2>/dev/null; then
        ensure_firmware
        printf '%s\n' "$QEMU_PREFIX/bin/qemu-system-x86_64"; return
    fi
    mkdir -p "$CACHE"
    exec 9>"$CACHE/.qemu.lock"
    flock 9
    if ! cached_qemu_ok 2>/dev/null; then
        build_qemu
    fi
    printf '%s\n' "$QEMU_PREFIX/bin/qemu-system-x86_64"
}

# The guest: Debian stable's newest 6.1 kernel (unsigned image) and busybox-static, unpacked
# with dpkg -x (nothing installed on the host).
# The guest's kernel modules, shared by find_guest and add_guest_modules: MODDIR is the
# unpacked package's lib/modules/KVER/kernel, ORDER the load order so far (dependencies
# first). The .deb has no modules.dep and the host may have no depmod: each module's own
# "depends=" entry in its .modinfo strings names what it needs.
MODDIR= KVER= ORDER=()

# Module name (- and _ are the same) -> its path under MODDIR.
module_file() {
    local pat="${1//[-_]/[-_]}"
    find "$MODDIR" -regex ".*/$pat\.ko" | head -n1
}

# Copy module $1 into the guest directory after what it depends on, appending to ORDER.
add_module() {
    local name="${1//-/_}" seen f dep
    for seen in "${ORDER[@]}"; do [ "$seen" = "$name" ] && return 0; done
    f=$(module_file "$1")
    [ -n "$f" ] || die "module $1 is not in the $KVER package"
    for dep in $(tr '\0' '\n' <"$f" | sed -n 's/^depends=//p' | tr , ' '); do
        add_module "$dep"
    done
    ORDER+=("$name")
    cp "$f" "$GUEST_DIR/modules/$name.ko"
}

find_guest() {
    if [ -f "$GUEST_DIR/vmlinuz" ] && [ -x "$GUEST_DIR/busybox" ] && [ -d "$GUEST_DIR/modules" ]; then
        # A guest unpacked before a module was listed: add it.
        add_guest_modules $GUEST_EXTRA_MODULES
        printf '%s\n' "$GUEST_DIR"; return
    fi
    mkdir -p "$CACHE"
    exec 8>"$CACHE/.guest.lock"
    flock 8
    local work="$CACHE/build-guest"
    rm -rf "$work"; mkdir -p "$work"
    local pkg
    pkg=$(apt-cache search --names-only '^linux-image-6\.1\.0-[0-9]+-amd64-unsigned$' | awk '{print $1}' | sort -V | tail -n1)
    if [ -z "$pkg" ]; then
        need_root_for_packages "(apt-get update)"
        apt-get update -q >&2
        pkg=$(apt-cache search --names-only '^linux-image-6\.1\.0-[0-9]+-amd64-unsigned$' | awk '{print $1}' | sort -V | tail -n1)
    fi
    [ -n "$pkg" ] || die "no linux-image-6.1.0-*-amd64-unsigned package in the apt index"
    say "downloading $pkg and busybox-static (apt-get download; nothing is installed)"
    (cd "$work" && apt-get -o APT::Sandbox::User=root download -q "$pkg" busybox-static >&2)
    for deb in "$work"/*.deb; do dpkg -x "$deb" "$work/root"; done
    local kver
    kver=$(ls "$work/root/lib/modules" | head -n1)
    rm -rf "$GUEST_DIR"; mkdir -p "$GUEST_DIR"
    cp "$work/root/boot/vmlinuz-$kver" "$GUEST_DIR/vmlinuz"
    cp "$work/root/bin/busybox" "$GUEST_DIR/busybox"
    # Only the modules the suite loads and what they depend on, in load order (add_module).
    mkdir -p "$GUEST_DIR/modules"
    local m
    MODDIR="$work/root/lib/modules/$kver/kernel" KVER=$kver ORDER=()
    for m in uio_pci_generic vfio_pci vfio_iommu_type1 $GUEST_EXTRA_MODULES; do add_module "$m"; done
    printf '%s\n' "${ORDER[@]}" >"$GUEST_DIR/modules/order"
    printf '%s\n' "$kver" >"$GUEST_DIR/kernel-version"
    rm -rf "$work"
    say "guest kernel $kver and busybox in $GUEST_DIR"
    printf '%s\n' "$GUEST_DIR"
}

# Add modules (and their dependencies) to an existing guest directory, from the package of
# its own kernel version: files are only added, and modules/order is replaced atomically
# (what is already listed keeps its place), so a run using the directory meanwhile is safe.
add_guest_modules() {
    mkdir -p "$CACHE"
    exec 8>"$CACHE/.guest.lock"
    flock 8
    local missing=0 m
    for m in "$@"; do [ -f "$GUEST_DIR/modules/${m//-/_}.ko" ] || missing=1; done
    [ "$missing" = 1 ] || return 0
    local kver work="$CACHE/build-guest-modules"
    kver=$(cat "$GUEST_DIR/kernel-version")
    rm -rf "$work"; mkdir -p "$work"
    say "adding modules $* to the guest (apt-get download linux-image-$kver-unsigned; nothing is installed)"
    (cd "$work" && apt-get -o APT::Sandbox::User=root download -q "linux-image-$kver-unsigned" >&2) \
        || die "cannot download linux-image-$kver-unsigned for the modules $*"
    dpkg -x "$work"/*.deb "$work/root"
    MODDIR="$work/root/lib/modules/$kver/kernel" KVER=$kver
    mapfile -t ORDER <"$GUEST_DIR/modules/order"
    for m in "$@"; do add_module "$m"; done
    printf '%s\n' "${ORDER[@]}" >"$GUEST_DIR/modules/order.new"
    mv "$GUEST_DIR/modules/order.new" "$GUEST_DIR/modules/order"
    rm -rf "$work"
}

case "${1:-}" in
    qemu) find_qemu ;;
    guest) find_guest ;;
    env)
        q=$(find_qemu); g=$(find_guest)
        printf 'QEMU_BIN=%q\nUMDEV_GUEST_DIR=%q\nQEMU_FIRMWARE=%q\n' "$q" "$g" "$(firmware_flags)" ;;
    firmware) firmware_flags ;;
    -h|--help|"")
        sed -n '2,32p' "$0" | sed 's/^# \{0,1\}//'
        [ -n "${1:-}" ] ;;
    *) die "unknown command '$1' (try --help)" ;;
esac
