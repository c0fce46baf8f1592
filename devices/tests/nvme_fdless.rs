//! NVMe with fd-less guest RAM (QEMU's default RAM): nothing can be pinned, so the rings
//! and the data go through the DMA layer's DMA_READ/DMA_WRITE messages, which the embedded
//! VMM answers. Slower, and it works.

mod nvme_support;

use nvme_support::*;
use umdev_devices::nvme::spec::{io_op, Command, Status};

#[test]
fn test_fdless_probe_identify_and_io_verify() {
    let mut g = Guest::fdless();
    g.bring_up(2, 32);
    assert_eq!(g.identify(0, 1, DATA), Status::SUCCESS);
    let ns = g.mem_read(DATA, 8);
    assert_eq!(u64::from_le_bytes(ns.try_into().unwrap()), NS_BYTES / 512);
    for (i, len) in [512usize, 4096, 12288, 64 << 10].into_iter().enumerate() {
        let qid = 1 + (i % 2) as u16;
        let data = pattern(100 + i as u64, len);
        let slba = 256 * i as u64;
        assert_eq!(
            g.write_blocks(qid, slba, DATA + 0x200, &data),
            Status::SUCCESS
        );
        let (s, back) = g.read_blocks(qid, slba, DATA + 0x40000, len);
        assert_eq!(s, Status::SUCCESS);
        assert_eq!(back, data, "{len} bytes through DMA_READ/DMA_WRITE");
        assert_eq!(image_bytes(&g.image, slba * 512, len).unwrap(), data);
    }
    let flush = Command {
        opcode: io_op::FLUSH,
        nsid: 1,
        ..Default::default()
    };
    assert_eq!(g.run(1, flush).status, Status::SUCCESS);
    assert!(
        g.vmm.requests() > 0,
        "the device reached memory through the client"
    );
    assert_eq!(g.pins(), (0, 0, 0), "nothing pinned in fd-less memory");
    g.assert_no_panics();
}

#[test]
fn test_fdless_bad_prp_list_is_data_transfer_error() {
    let mut g = Guest::fdless();
    g.bring_up(1, 16);
    let s = g.run(1, Guest::rw(false, 0, 24, DATA, HOLE)).status;
    assert_eq!(s, Status::DATA_TRANSFER_ERROR);
    let s = g.run(1, Guest::rw(true, 0, 8, HOLE, 0)).status;
    assert_eq!(s, Status::DATA_TRANSFER_ERROR);
    assert_eq!(
        g.write_blocks(1, 0, DATA, &pattern(1, 4096)),
        Status::SUCCESS
    );
}
