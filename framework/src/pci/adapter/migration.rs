//! The [`Migrate`] of a [`PciAdapter`]: the framework's own PCI state, saved for every
//! migrating PCI device without its author's help, around the device's [`Migrate`].
//!
//! What the framework saves (format `umdev-pci`, version 1, [`PciStateV1`]):
//! - the 256 bytes of config space: command/status, the BAR addresses the guest
//!   programmed, interrupt line, the MSI capability (enable, MME, address, data, mask bits)
//!   and the MSI-X control word;
//! - the MSI-X table (address and data of each vector) and its vector-control mask bits;
//! - the MSI and MSI-X pending bits;
//! - the INTx line level (a trigger pending, or fired and not yet unmasked).
//!
//! The device's state is [`Migrate::save`] of the wrapped device. Both go into one blob
//! (format `umdev-pci-function`, version 1, [`FunctionStateV1`]): first the PCI section,
//! then the device's section, each a versioned [`encode_state`] of its own.
//!
//! Loading decodes both sections borrowed from the frame and the PCI section field by field
//! within this function's sizes (256 config bytes, its MSI-X vector count: a longer
//! declared length is refused before anything is allocated), and checks everything before
//! changing anything: the function format and version,
//! the PCI section's format and version, and that the PCI state fits this function (the
//! read-only bits of config space equal this function's, the MSI-X table and bitmaps have
//! this function's vector count). Only then does the device load its section; only if that
//! succeeds is the PCI state applied. The PCI state is applied without sending any
//! interrupt (the device is stopped); pending vectors and an asserted INTx line are
//! delivered when the device resumes, or by the next unmask.

use serde::{Deserialize, Serialize};

use super::{BmeCause, PciAdapter};
use crate::migration::{encode_state, Decoder, Migrate, MigrationCaps, MigrationError};
use crate::pci::config_space::{reg, status, CONFIG_SIZE};
use crate::pci::PciDevice;

/// Format of the blob the adapter saves.
pub const FUNCTION_FORMAT: &str = "umdev-pci-function";
/// Its version.
pub const FUNCTION_VERSION: u32 = 1;
/// Format of the framework's PCI section.
pub const PCI_FORMAT: &str = "umdev-pci";
/// Its version.
pub const PCI_VERSION: u32 = 1;

/// The blob: the framework's PCI section, then the device's section. [`function_blob`]
/// writes this encoding without the type (so the device's bytes are not copied); the test
/// holds both to one another.
#[cfg(test)]
#[derive(Serialize, Deserialize)]
struct FunctionStateV1 {
    pci: Vec<u8>,
    device: Vec<u8>,
}

/// The framework's PCI state.
#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct PciStateV1 {
    config: Vec<u8>,
    msix_table: Vec<[u32; 3]>,
    msix_guest_mask: Vec<u64>,
    msix_pending: Vec<u64>,
    msi_pending: u64,
    intx_level: bool,
}

/// Framing of the function blob around its two sections (header, two lengths).
const FUNCTION_OVERHEAD: u64 = 64;

/// The encoding of [`FunctionStateV1`] `{ pci, device }`, built around the device's
/// buffer instead of copied out of it: the header, the PCI section and the device section's
/// length (postcard writes a byte sequence as its length, a varint like a `usize`, then the
/// bytes), put in front of `device` in place. A device state of hundreds of MiB (a
/// virtio-gpu's resources) is then held once while saving, not twice.
fn function_blob(pci: Vec<u8>, mut device: Vec<u8>) -> Result<Vec<u8>, MigrationError> {
    let prefix = encode_state(FUNCTION_FORMAT, FUNCTION_VERSION, &(pci, device.len()))?;
    device.try_reserve_exact(prefix.len()).map_err(|e| {
        MigrationError::Device(format!(
            "{FUNCTION_FORMAT} state of {} bytes: {e}",
            device.len()
        ))
    })?;
    device.splice(0..0, prefix);
    Ok(device)
}

fn incompatible(why: String) -> MigrationError {
    MigrationError::Incompatible(format!("PCI state does not fit this function: {why}"))
}

impl<D: PciDevice> PciAdapter<D> {
    fn device_migration(&mut self) -> Result<&mut dyn Migrate, MigrationError> {
        self.dev
            .migration()
            .ok_or_else(|| MigrationError::Device("the device no longer offers migration".into()))
    }

    fn pci_state(&self) -> PciStateV1 {
        let (msix_guest_mask, msix_pending) = self.irq.msix.snapshot();
        PciStateV1 {
            config: self.space.bytes().to_vec(),
            msix_table: self
                .msix_table
                .as_ref()
                .map_or_else(Vec::new, |t| t.entries().to_vec()),
            msix_guest_mask,
            msix_pending,
            msi_pending: self.irq.msi.snapshot().1.first().copied().unwrap_or(0),
            intx_level: self.irq.intx.level(),
        }
    }

    /// Config bits whose values the adapter computes before every read (offset, mask):
    /// neither compared nor taken on load.
    fn computed_ranges(&self) -> Vec<(usize, u32)> {
        let mut r = vec![(reg::STATUS, u32::from(status::INTERRUPT))];
        if let Some(cap) = self.caps.msi {
            let (offset, len) = cap.pending_range();
            debug_assert_eq!(len, 4);
            r.push((offset, u32::MAX));
        }
        r
    }

    fn msix_vectors(&self) -> usize {
        self.msix_table.as_ref().map_or(0, |t| t.entries().len())
    }

    /// Upper bound of the encoded PCI section of this function: header, 256 config bytes,
    /// the MSI-X table (three varint u32 per vector) and bitmaps (varint u64 per 64
    /// vectors), the MSI pending word, the INTx level, each length a varint.
    fn max_pci_section(&self) -> u64 {
        let vectors = self.msix_vectors() as u64;
        let words = vectors.div_ceil(64);
        64 + 5 + CONFIG_SIZE as u64 + 5 + vectors * 15 + 2 * (5 + words * 10) + 10 + 1
    }

    /// Decode a PCI section within this function's sizes: every declared length is checked
    /// against this function's before anything is allocated for it.
    fn decode_pci_state(&self, bytes: &[u8]) -> Result<PciStateV1, MigrationError> {
        let (_, mut d) = Decoder::new(PCI_FORMAT, 1, PCI_VERSION, bytes)?;
        let config = d.bytes()?;
        if config.len() != CONFIG_SIZE {
            return Err(incompatible(format!(
                "config space of {} bytes, this function has {CONFIG_SIZE}",
                config.len()
            )));
        }
        let vectors = self.msix_vectors();
        let n = d.seq_len(usize::MAX, 3)?;
        if n != vectors {
            return Err(incompatible(format!(
                "MSI-X table of {n} vectors, this function has {vectors}"
            )));
        }
        let msix_table = (0..n).map(|_| d.value()).collect::<Result<_, _>>()?;
        let words = vectors.div_ceil(64);
        let mut bitmap = |what: &str| -> Result<Vec<u64>, MigrationError> {
            let n = d.seq_len(usize::MAX, 1)?;
            if n != words {
                return Err(incompatible(format!(
                    "MSI-X {what} bitmap of {n} words, this function has {words}"
                )));
            }
            (0..n).map(|_| d.value()).collect()
        };
        let msix_guest_mask = bitmap("mask")?;
        let msix_pending = bitmap("pending")?;
        let st = PciStateV1 {
            config: config.to_vec(),
            msix_table,
            msix_guest_mask,
            msix_pending,
            msi_pending: d.value()?,
            intx_level: d.value()?,
        };
        d.finish()?;
        Ok(st)
    }

    /// Everything [`Self::apply_pci_state`] would refuse, refused without changing anything.
    fn check_pci_state(&self, st: &PciStateV1) -> Result<(), MigrationError> {
        let mut probe = self.space.clone();
        probe
            .restore(&st.config, &self.computed_ranges())
            .map_err(incompatible)?;
        let vectors = self.msix_table.as_ref().map_or(0, |t| t.entries().len());
        if st.msix_table.len() != vectors {
            return Err(incompatible(format!(
                "MSI-X table of {} vectors, this function has {vectors}",
                st.msix_table.len()
            )));
        }
        let words = vectors.div_ceil(64);
        if st.msix_guest_mask.len() != words || st.msix_pending.len() != words {
            return Err(incompatible(format!(
                "MSI-X bitmaps of {}/{} words, this function has {words}",
                st.msix_guest_mask.len(),
                st.msix_pending.len()
            )));
        }
        Ok(())
    }

    /// Apply a checked PCI state: config space, MSI-X table, interrupt state (nothing is
    /// sent), then the Bus Master switch.
    fn apply_pci_state(&mut self, st: &PciStateV1) -> Result<(), MigrationError> {
        self.check_pci_state(st)?;
        let computed = self.computed_ranges();
        self.space
            .restore(&st.config, &computed)
            .map_err(incompatible)?;
        if let Some(t) = self.msix_table.as_mut() {
            t.restore(&st.msix_table).map_err(incompatible)?;
        }
        let cmd = self.space.u16(reg::COMMAND);
        let intx_disabled = cmd & crate::pci::config_space::command::INTX_DISABLE != 0;
        self.irq.intx.restore(intx_disabled, st.intx_level);
        if let Some(cap) = self.caps.msi {
            let mask = u64::from(cap.mask_bits(&self.space));
            self.irq.msi.restore(
                cap.enabled_vectors(&self.space),
                false,
                &[mask],
                &[st.msi_pending],
            );
        }
        if let Some(cap) = self.caps.msix {
            let (enabled, function_mask) = cap.control(&self.space);
            let count = if enabled { self.irq.msix.count() } else { 0 };
            self.irq
                .msix
                .restore(count, function_mask, &st.msix_guest_mask, &st.msix_pending);
        }
        self.sync_bus_master(BmeCause::Migration);
        Ok(())
    }
}

impl<D: PciDevice> Migrate for PciAdapter<D> {
    fn caps(&self) -> MigrationCaps {
        self.mig_caps.unwrap_or_default()
    }

    fn stop(&mut self) -> Result<(), MigrationError> {
        self.device_migration()?.stop()
    }

    /// The device resumes; then interrupts that came in with the state (or pended while it
    /// was stopped) and are deliverable now are sent.
    fn resume(&mut self) -> Result<(), MigrationError> {
        self.device_migration()?.resume()?;
        let irq = &self.irq;
        irq.intx.retry(|| irq.send_intx());
        irq.msi.flush_all(|v| irq.send_msi(v));
        irq.msix.flush_all(|v| irq.send_msix(v));
        Ok(())
    }

    fn save(&mut self) -> Result<Vec<u8>, MigrationError> {
        let pci = encode_state(PCI_FORMAT, PCI_VERSION, &self.pci_state())?;
        let device = self.device_migration()?.save()?;
        function_blob(pci, device)
    }

    /// The device's own limit plus the PCI section of this function (its MSI-X vector
    /// count fixes its size) and the framing around both.
    fn max_state_size(&self) -> u64 {
        self.mig_max_state
            .saturating_add(self.max_pci_section())
            .saturating_add(FUNCTION_OVERHEAD)
    }

    fn load(&mut self, state: &[u8]) -> Result<(), MigrationError> {
        // Both sections are borrowed out of the frame, the PCI one decoded within this
        // function's sizes (no copy, nothing allocated from a declared length).
        let (_, mut f) = Decoder::new(FUNCTION_FORMAT, 1, FUNCTION_VERSION, state)?;
        let pci = f.bytes()?;
        let device = f.bytes()?;
        f.finish()?;
        let pci = self.decode_pci_state(pci)?;
        self.check_pci_state(&pci)?;
        self.device_migration()?.load(device)?;
        self.apply_pci_state(&pci)
    }

    fn precopy(&mut self) -> Result<Option<Vec<u8>>, MigrationError> {
        self.device_migration()?.precopy()
    }

    fn load_precopy(&mut self, chunk: &[u8]) -> Result<(), MigrationError> {
        self.device_migration()?.load_precopy(chunk)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Device;
    use crate::migration::decode_state;
    use crate::pci::{BarKind, BarSpec, MsixSpec, PciConfig};

    /// Registers only; migrates them.
    #[derive(Default)]
    struct Regs {
        regs: [u32; 4],
        id: u16,
    }

    impl Migrate for Regs {
        fn stop(&mut self) -> Result<(), MigrationError> {
            Ok(())
        }
        fn resume(&mut self) -> Result<(), MigrationError> {
            Ok(())
        }
        fn save(&mut self) -> Result<Vec<u8>, MigrationError> {
            encode_state("regs", 1, &self.regs)
        }
        fn load(&mut self, state: &[u8]) -> Result<(), MigrationError> {
            self.regs = decode_state("regs", 1, 1, state)?.1;
            Ok(())
        }
    }

    impl PciDevice for Regs {
        fn config(&self) -> PciConfig {
            PciConfig {
                ids: crate::pci::PciIds {
                    vendor: 0x1b36,
                    device: self.id,
                    ..Default::default()
                },
                bars: vec![BarSpec {
                    index: 0,
                    size: 0x2000,
                    kind: BarKind::Mmio32,
                    prefetchable: false,
                    shared: None,
                }],
                intx: true,
                msi_vectors: 4,
                msix: Some(MsixSpec {
                    vectors: 70,
                    table_bar: 0,
                    table_offset: 0x1000,
                    pba_bar: 0,
                    pba_offset: 0x1800,
                }),
                registers: Vec::new(),
                vendor_capabilities: Vec::new(),
            }
        }
        fn bar_read(&mut self, _bar: usize, offset: u64, data: &mut [u8]) {
            let v = self.regs.get(offset as usize / 4).copied().unwrap_or(0);
            let n = data.len().min(4);
            data[..n].copy_from_slice(&v.to_le_bytes()[..n]);
        }
        fn bar_write(&mut self, _bar: usize, offset: u64, data: &[u8]) {
            if let (Some(r), Ok(b)) = (self.regs.get_mut(offset as usize / 4), data.try_into()) {
                *r = u32::from_le_bytes(b);
            }
        }
        fn migration(&mut self) -> Option<&mut dyn Migrate> {
            Some(self)
        }
    }

    fn adapter(id: u16) -> PciAdapter<Regs> {
        PciAdapter::new(Regs {
            id,
            ..Default::default()
        })
        .unwrap()
    }

    fn cfg_read(a: &mut PciAdapter<Regs>, off: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        a.region_read(7, off, &mut v).unwrap();
        v
    }

    #[test]
    fn test_pci_state_round_trip_config_msix_table_masks_and_device() {
        let mut src = adapter(1);
        src.region_write(7, 0x10, &0xfebc_0000u32.to_le_bytes())
            .unwrap();
        src.region_write(7, 0x04, &0x0406u16.to_le_bytes()).unwrap();
        src.region_write(7, 0x3c, &[11]).unwrap();
        // MSI-X entry 65: address, data, masked.
        src.region_write(
            0,
            0x1000 + 65 * 16,
            &[0x10, 0, 0xe0, 0xfe, 0, 0, 0, 0, 0x42, 0, 0, 0, 1, 0, 0, 0],
        )
        .unwrap();
        src.region_write(0, 8, &7u32.to_le_bytes()).unwrap();
        let blob = src.save().unwrap();

        let mut dst = adapter(1);
        dst.load(&blob).unwrap();
        assert_eq!(cfg_read(&mut dst, 0, 256), cfg_read(&mut src, 0, 256));
        assert_eq!(dst.bar_address(0), 0xfebc_0000);
        assert!(dst.bus_master_enabled());
        let mut e = [0u8; 16];
        dst.region_read(0, 0x1000 + 65 * 16, &mut e).unwrap();
        assert_eq!(
            e,
            [0x10, 0, 0xe0, 0xfe, 0, 0, 0, 0, 0x42, 0, 0, 0, 1, 0, 0, 0]
        );
        let mut r = [0u8; 4];
        dst.region_read(0, 8, &mut r).unwrap();
        assert_eq!(u32::from_le_bytes(r), 7, "the device's own section");
    }

    #[test]
    fn test_function_blob_is_the_encoding_of_both_sections() {
        for (pci, device) in [
            (vec![1u8, 2, 3], vec![]),
            (vec![], vec![9u8; 127]),
            (
                vec![7u8; 300],
                (0..70_000u32).map(|i| i as u8).collect::<Vec<u8>>(),
            ),
        ] {
            let whole = encode_state(
                FUNCTION_FORMAT,
                FUNCTION_VERSION,
                &FunctionStateV1 {
                    pci: pci.clone(),
                    device: device.clone(),
                },
            )
            .unwrap();
            assert_eq!(function_blob(pci, device).unwrap(), whole);
        }
    }

    #[test]
    fn test_pci_state_of_another_device_refused_and_nothing_changes() {
        let mut src = adapter(1);
        src.region_write(0, 0, &5u32.to_le_bytes()).unwrap();
        let blob = src.save().unwrap();
        let mut other = adapter(2);
        other.region_write(0, 0, &9u32.to_le_bytes()).unwrap();
        let before = cfg_read(&mut other, 0, 256);
        let e = other.load(&blob).unwrap_err();
        assert!(matches!(e, MigrationError::Incompatible(_)), "{e}");
        assert_eq!(cfg_read(&mut other, 0, 256), before);
        let mut r = [0u8; 4];
        other.region_read(0, 0, &mut r).unwrap();
        assert_eq!(u32::from_le_bytes(r), 9, "the device was not loaded");
    }

    /// `blob` with its PCI section's config space changed by `edit`.
    fn with_config(blob: &[u8], edit: impl FnOnce(&mut [u8])) -> Vec<u8> {
        let (_, f): (u32, FunctionStateV1) =
            decode_state(FUNCTION_FORMAT, 1, FUNCTION_VERSION, blob).unwrap();
        let (_, mut pci): (u32, PciStateV1) =
            decode_state(PCI_FORMAT, 1, PCI_VERSION, &f.pci).unwrap();
        edit(&mut pci.config);
        let pci = encode_state(PCI_FORMAT, PCI_VERSION, &pci).unwrap();
        encode_state(
            FUNCTION_FORMAT,
            FUNCTION_VERSION,
            &FunctionStateV1 {
                pci,
                device: f.device,
            },
        )
        .unwrap()
    }

    #[test]
    fn test_pci_state_status_read_only_bits_changed_refused_and_status_kept() {
        let mut src = adapter(1);
        let blob = src.save().unwrap();
        let mut dst = adapter(1);
        let before = cfg_read(&mut dst, 0x06, 2);
        assert_eq!(
            u16::from_le_bytes([before[0], before[1]]) & status::CAP_LIST,
            status::CAP_LIST
        );
        // The stream of the issue: Capabilities List cleared, DEVSEL timing and 66 MHz set.
        let bad = with_config(&blob, |c| {
            c[0x06..0x08].copy_from_slice(&0x0220u16.to_le_bytes())
        });
        let e = dst.load(&bad).unwrap_err();
        assert!(matches!(e, MigrationError::Incompatible(_)), "{e}");
        assert_eq!(cfg_read(&mut dst, 0x06, 2), before, "STATUS unchanged");
        // A W1C error bit this function never sets: refused too.
        let bad = with_config(&blob, |c| c[0x07] |= 0x80);
        assert!(dst.load(&bad).is_err());
        // The computed interrupt bit is neither compared nor taken: it follows the INTx
        // state that came with the stream (none here).
        let ok = with_config(&blob, |c| c[0x06] |= status::INTERRUPT as u8);
        dst.load(&ok).unwrap();
        assert_eq!(cfg_read(&mut dst, 0x06, 2), before);
    }
}
