#!/usr/bin/env bash
# umdev's real-VMM suite: QEMU (>= 10.1, vfio-user-pci) boots a Debian guest kernel with
# umdev's example devices attached; a static Rust program inside the guest drives them like a
# guest driver. The first run on a machine builds QEMU 10.2.2 with one upstream unplug fix
# (~15-25 minutes on 2 cores; scripts/qemu.sh says why) and downloads the guest kernel.
#
#   scripts/vm-tests.sh [umdev-vmtest options]     e.g. --only memfd --verbose; --help for all
set -euo pipefail
cd "$(dirname "$0")/.."

for a in "$@"; do
    if [ "$a" = "-h" ] || [ "$a" = "--help" ]; then
        sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'
        echo
        cargo run --quiet --release -p umdev-vmtest -- --help
        exit 0
    fi
done

# QEMU_BIN and UMDEV_GUEST_DIR (found, or built/downloaded into the cache).
eval "$(scripts/qemu.sh env)"
export QEMU_BIN UMDEV_GUEST_DIR

echo "vm-tests: building umdev, the hello example and the harness (release)" >&2
cargo build --release --quiet -p umdev-cli --bins --examples
cargo build --release --quiet -p umdev-vmtest

# The guest program runs on a busybox initramfs with no libc: link it statically. Its own
# target directory keeps these flags from invalidating the host build.
host=$(rustc -vV | sed -n 's/^host: //p')
echo "vm-tests: building umdev-guest (static, $host)" >&2
RUSTFLAGS="-C target-feature=+crt-static" \
    cargo build --release --quiet -p umdev-guest --target "$host" --target-dir target/guest

exec target/release/umdev-vmtest \
    --guest-bin "target/guest/$host/release/umdev-guest" \
    --umdev target/release/umdev \
    --hello target/release/examples/hello \
    "$@"
