//! The publishable crates package what they need: `cargo package --list` (offline, no build)
//! of `umdev` holds the guide that `umdev::guide` includes, and both crates hold their
//! README and LICENSE and nothing from outside their directories.

use std::path::Path;
use std::process::Command;

/// The files `cargo package --list` would put into `package`'s `.crate`.
fn package_list(package: &str) -> Vec<String> {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"));
    let output = Command::new(env!("CARGO"))
        .args([
            "package",
            "--list",
            "--allow-dirty",
            "--offline",
            "-p",
            package,
        ])
        .current_dir(workspace)
        .output()
        .expect("run cargo package --list");
    assert!(
        output.status.success(),
        "cargo package --list -p {package} failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout)
        .expect("file list is UTF-8")
        .lines()
        .map(str::to_owned)
        .collect()
}

/// The path, relative to `framework/`, of the file `framework/src/lib.rs` includes as the guide.
fn guide_include_path() -> String {
    let lib = include_str!("../framework/src/lib.rs");
    let (_, rest) = lib
        .split_once("#[doc = include_str!(\"")
        .expect("umdev's lib.rs includes the guide with #[doc = include_str!(...)]");
    let (relative_to_src, _) = rest.split_once('"').expect("a closed string");
    let path = Path::new("src").join(relative_to_src);
    // Normalise `src/../docs/x.md` to `docs/x.md`; a path that climbs out of the crate stays
    // with its `..` and is then missing from the list.
    let mut parts: Vec<&str> = Vec::new();
    for part in path.iter().map(|p| p.to_str().expect("UTF-8 path")) {
        match part {
            ".." if parts.last().is_some_and(|last| *last != "..") => {
                parts.pop();
            }
            "." => {}
            _ => parts.push(part),
        }
    }
    parts.join("/")
}

#[test]
fn test_package_umdev_lists_the_included_guide() {
    let files = package_list("umdev");
    let guide = guide_include_path();
    assert!(
        !guide.starts_with(".."),
        "the guide ({guide}) is outside framework/, so the published crate cannot build its docs"
    );
    assert!(
        files.contains(&guide),
        "{guide} missing from umdev's package: {files:?}"
    );
}

#[test]
fn test_package_publishable_crates_have_readme_and_license_and_no_stray_files() {
    for package in ["umdev", "umdev-devices"] {
        let files = package_list(package);
        for needed in ["Cargo.toml", "README.md", "LICENSE", "src/lib.rs"] {
            assert!(
                files.iter().any(|f| f == needed),
                "{package}: {needed} missing: {files:?}"
            );
        }
        let allowed = [
            "src/",
            "tests/",
            "examples/",
            "docs/",
            "proptest-regressions/",
        ];
        let top_level = [
            ".cargo_vcs_info.json",
            "Cargo.lock",
            "Cargo.toml",
            "Cargo.toml.orig",
            "README.md",
            "LICENSE",
        ];
        for file in &files {
            assert!(
                top_level.contains(&file.as_str())
                    || allowed.iter().any(|dir| file.starts_with(dir)),
                "{package}: unexpected file in the package: {file}"
            );
        }
    }
}
