//! Every client→server decoder fed arbitrary bytes: the first 16 bytes are the header
//! (validated first, as the server does), one byte picks the fd count and the limits, the
//! rest is the payload. Also the reply decoders of server→client DMA and VERSION
//! negotiation, and the migration stream: the payload fed to a `StreamReader` in two pieces
//! (split where the knob says) and, whole, to a PCI function's `Migrate::load` (the
//! framework's PCI section and a device section), and the GPU's bounded decoders of a
//! PRE_COPY chunk and a state (declared page counts, duplicates, page lengths, checked
//! in the frame without collecting the pages). Nothing may panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use umdev::protocol::dma_rw::{
    decode_dma_read_reply, decode_dma_rw_request, decode_dma_write_reply,
};
use umdev::migration::stream::StreamReader;
use umdev::migration::{decode_state, encode_state, Migrate, MigrationError};
use umdev::pci::{BarKind, BarSpec, MsixSpec, PciAdapter, PciConfig, PciDevice};
use umdev::protocol::version::{negotiate, ServerOffer, Version};
use umdev::protocol::{decode_request, Header, Limits, MessageType, HEADER_SIZE};
use umdev_devices::gpu::migration::wire::{decode_chunk_v1, decode_state_v1};

fuzz_target!(|data: &[u8]| {
    if data.len() < HEADER_SIZE + 1 {
        return;
    }
    let knobs = data[HEADER_SIZE];
    let payload = &data[HEADER_SIZE + 1..];
    let Ok(mut hdr) = Header::decode(&data[..HEADER_SIZE]) else {
        return;
    };
    let _ = hdr.validate(1 << 20);
    // Let the size field agree with the payload most of the time.
    if knobs & 0x80 == 0 {
        hdr.msg_size = (HEADER_SIZE + payload.len()) as u32;
    }
    let limits = Limits {
        max_data_xfer_size: if knobs & 0x40 != 0 { 4096 } else { 1 << 20 },
        max_msg_fds: 16,
        pgsize: 4096,
        write_multiple: knobs & 0x20 != 0,
    };
    let nfds = (knobs & 0x1f) as usize;
    if let Ok((MessageType::Command, _)) = hdr.validate(u32::MAX) {
        if let Ok(req) = decode_request(&hdr, payload, nfds, &limits) {
            let _ = format!("{req:?}");
        }
    }
    if let Ok(v) = Version::decode(payload) {
        let offer = ServerOffer {
            max_msg_fds: 16,
            max_data_xfer_size: 1 << 20,
            max_dma_maps: 65535,
            pgsize: 4096,
            twin_socket: knobs & 1 != 0,
            migration: knobs & 2 != 0,
        };
        if let Ok(n) = negotiate(&v, &offer, HEADER_SIZE + payload.len()) {
            let _ = n.reply.encode_payload();
        }
    }
    // The migration stream, in two pieces.
    let split = usize::from(knobs).min(payload.len());
    let mut sink = Sink(0);
    let mut reader = StreamReader::new();
    if reader.feed(&payload[..split], &mut sink).is_ok()
        && reader.feed(&payload[split..], &mut sink).is_ok()
    {
        if let Ok(state) = reader.finish() {
            let _ = adapter().load(&state);
        }
    }
    // The PCI function state alone (the framework's PCI section, then the device's).
    let _ = adapter().load(payload);
    // The GPU's decoders, for a 64 KiB framebuffer (16 pages).
    const FB: u64 = 64 * 1024;
    if let Ok((_, pages)) = decode_chunk_v1(payload, FB) {
        let _ = pages.check(FB);
    }
    if let Ok((state, pages)) = decode_state_v1(payload, FB) {
        let _ = state.check_regs(FB);
        let _ = pages.check(FB);
    }
    let _ = decode_dma_rw_request(payload);
    let iova = u64::from(hdr.msg_id) << 12;
    let count = u64::from(hdr.error);
    let _ = decode_dma_read_reply(payload, iova, count);
    let _ = decode_dma_write_reply(payload, iova, count);
});

/// A migrating device whose own section is a u32 register file.
struct Sink(u32);

impl Migrate for Sink {
    fn stop(&mut self) -> Result<(), MigrationError> {
        Ok(())
    }
    fn resume(&mut self) -> Result<(), MigrationError> {
        Ok(())
    }
    fn save(&mut self) -> Result<Vec<u8>, MigrationError> {
        encode_state("fuzz", 1, &self.0)
    }
    fn load(&mut self, state: &[u8]) -> Result<(), MigrationError> {
        self.0 = decode_state("fuzz", 1, 1, state)?.1;
        Ok(())
    }
    fn load_precopy(&mut self, _chunk: &[u8]) -> Result<(), MigrationError> {
        Ok(())
    }
}

impl PciDevice for Sink {
    fn config(&self) -> PciConfig {
        PciConfig {
            bars: vec![BarSpec {
                index: 0,
                size: 0x1000,
                kind: BarKind::Mmio32,
                prefetchable: false,
                shared: None,
            }],
            intx: true,
            msi_vectors: 2,
            msix: Some(MsixSpec {
                vectors: 3,
                table_bar: 0,
                table_offset: 0x800,
                pba_bar: 0,
                pba_offset: 0xc00,
            }),
            ..Default::default()
        }
    }
    fn bar_read(&mut self, _bar: usize, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }
    fn bar_write(&mut self, _bar: usize, _offset: u64, _data: &[u8]) {}
    fn migration(&mut self) -> Option<&mut dyn Migrate> {
        Some(self)
    }
}

fn adapter() -> PciAdapter<Sink> {
    PciAdapter::new(Sink(0)).expect("a valid configuration")
}
