//! `umdev demo gpu|ccw` end to end: the binary starts the device, drives it with the
//! embedded VMM, and must leave no DMA state behind.

use std::process::Command;

fn umdev() -> Command {
    Command::new(env!("CARGO_BIN_EXE_umdev"))
}

#[test]
fn test_demo_gpu_writes_png_with_expected_pixels() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("demo.png");
    let o = umdev()
        .args(["demo", "gpu", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "demo failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("fence MSI fired: true"), "{stdout}");
    assert!(
        stdout.contains("0 DMA maps, 0 pinned pages, 0 locked pages"),
        "{stdout}"
    );

    let decoder = png::Decoder::new(std::fs::File::open(&out).unwrap());
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).unwrap();
    assert_eq!((info.width, info.height), (640, 480));
    let px = |x: usize, y: usize| {
        let i = (y * 640 + x) * 3;
        [buf[i], buf[i + 1], buf[i + 2]]
    };
    assert_eq!(px(5, 5), [0x20, 0x28, 0x48], "background fill");
    assert_eq!(px(45, 335), [0xe0, 0x40, 0x40], "first rectangle");
    // Blitted gradient at (60,60): surface pixel (x,y) = (2x, 2y, 0xc0).
    assert_eq!(
        px(60 + 10, 60 + 20),
        [20, 40, 0xc0],
        "blit from scattered GTT pages"
    );
    assert_eq!(px(460 + 10, 60 + 20), [20, 40, 0xc0], "copy of the blit");
}

#[test]
fn test_demo_ccw_verifies_every_program() {
    let o = umdev().args(["demo", "ccw"]).output().unwrap();
    assert!(
        o.status.success(),
        "demo failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert_eq!(stdout.matches("data verified").count(), 3, "{stdout}");
    assert!(
        stdout.contains("0 DMA maps, 0 pinned pages, 0 locked pages"),
        "{stdout}"
    );
}

#[test]
fn test_demo_migrate_scene_identical_data_intact_exit_zero() {
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("shared.img");
    let o = umdev()
        .args(["demo", "migrate", "--out-dir"])
        .arg(dir.path())
        .arg("--image")
        .arg(&image)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "demo failed: {stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(stdout.matches("pixel-identical").count(), 2, "{stdout}");
    assert!(
        stdout.contains("read back on the destination: intact"),
        "{stdout}"
    );
    assert!(
        stdout.contains("1 completion interrupt(s) in all, status ok"),
        "{stdout}"
    );
    assert!(stdout.contains("(target <= 10%): met"), "{stdout}");
    assert!(stdout.contains("verdict: migration ok"), "{stdout}");
    for row in ["gpu PRE_COPY", "gpu STOP_COPY", "ccw"] {
        assert!(
            stdout.lines().any(|l| l.starts_with(row)),
            "no {row} row: {stdout}"
        );
    }
    for png in ["migrate-reference.png", "migrate-destination.png"] {
        let decoder = png::Decoder::new(std::fs::File::open(dir.path().join(png)).unwrap());
        let info = decoder.read_info().unwrap();
        assert_eq!((info.info().width, info.info().height), (1024, 768));
    }
}

#[test]
fn test_demo_migrate_image_that_cannot_be_opened_fails_with_status_1() {
    let dir = tempfile::tempdir().unwrap();
    let o = umdev()
        .args(["demo", "migrate", "--out-dir"])
        .arg(dir.path())
        .arg("--image")
        .arg(dir.path().join("no/such/dir/img"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(!String::from_utf8_lossy(&o.stdout).contains("verdict: migration ok"));
}
