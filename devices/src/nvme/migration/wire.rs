//! The NVMe controller's migration format: a serde value ([`NvmeStateV1`]) behind umdev's
//! versioned header ([`umdev::migration::encode_state`]), read back field by field with a
//! [`Decoder`] ([`decode_state_v1`]) and checked against the destination controller's
//! limits ([`NvmeStateV1::check`]) before anything of it is applied.
//!
//! **Bounded reading.** Every sequence's declared length is checked against what this
//! controller can hold (a queue per id, [`MAX_PENDING`] completions per queue, the
//! Asynchronous Event Request limit, [`MAX_EVENTS`] events, a vector configuration per
//! interrupt vector) and against what the remaining bytes can encode before anything is
//! allocated for it; a queue id seen twice is refused while reading. So a hostile stream
//! costs at most the frame itself (itself bounded by [`max_encoded_size`], the controller's
//! `max_state_size`) and is an error, never a panic.
//!
//! A change of layout is a new version (a `…V2` next to this one); a build reads
//! `STATE_VERSION_MIN..=STATE_VERSION`.

use serde::{Deserialize, Serialize};
use umdev::migration::{Decoder, MigrationError};

use super::super::ctrl::{Limits, MAX_EVENTS};
use super::super::identify::AERL;
use super::super::regs::{CSTS_CFS, CSTS_RDY, CSTS_SHST_MASK};

/// Name of the NVMe controller's state format.
pub const STATE_FORMAT: &str = "umdev-nvme";
/// Version of the state format this build writes.
pub const STATE_VERSION: u32 = 1;
/// Oldest state version this build reads.
pub const STATE_VERSION_MIN: u32 = 1;
/// Most unposted completions one submission queue carries (its worker holds at most
/// `worker::MAX_IN_FLIGHT` from the I/O pool plus the few it ran itself).
pub const MAX_PENDING: usize = 256;
/// Largest admin queue (AQA's 12-bit fields).
pub const MAX_ADMIN_ENTRIES: u32 = 4096;
/// Most outstanding Asynchronous Event Requests (AERL is 0-based).
pub const MAX_AERS: usize = AERL as usize + 1;

/// The controller state, version 1 (field order is the wire order).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NvmeStateV1 {
    /// Namespace size in blocks (the destination's image must have as many).
    pub blocks: u64,
    /// The source's I/O queue pair limit (the destination's must match).
    pub max_io_queues: u16,
    /// The source's largest queue (the destination's must match).
    pub max_queue_entries: u32,
    /// CC as the guest wrote it.
    pub cc: u32,
    /// CC as latched when the controller was enabled.
    pub cc_enabled: u32,
    /// AQA.
    pub aqa: u32,
    /// ASQ.
    pub asq: u64,
    /// ACQ.
    pub acq: u64,
    /// CSTS.
    pub csts: u32,
    /// INTMS.
    pub intms: u32,
    /// The features set by Set Features.
    pub features: FeaturesV1,
    /// Command ids of outstanding Asynchronous Event Requests, oldest first.
    pub aer_outstanding: Vec<u16>,
    /// Events not yet reported (completion DW0), oldest first.
    pub aer_events: Vec<u32>,
    /// Event types masked until their log page is read.
    pub aer_masked: u8,
    /// The shadow doorbell and EventIdx pages, once configured.
    pub dbbuf: Option<(u64, u64)>,
    /// SMART counters: blocks read, blocks written, reads, writes, media errors.
    pub counters: [u64; 5],
    /// The completion queues (admin first).
    pub cqs: Vec<CqV1>,
    /// The submission queues (admin first).
    pub sqs: Vec<SqV1>,
}

/// The features (see `ctrl::Features`; field order is the wire order).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct FeaturesV1 {
    pub arbitration: u32,
    pub power_state: u32,
    pub temp_over: u16,
    pub temp_under: u16,
    pub error_recovery: u32,
    pub write_cache: bool,
    pub queues_granted: Option<(u16, u16)>,
    pub irq_coalescing: u32,
    /// Per-vector coalescing disable bits, one per interrupt vector.
    pub vector_config: Vec<bool>,
    pub write_atomicity: u32,
    pub async_event_config: u32,
}

/// A completion queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct CqV1 {
    pub id: u16,
    pub size: u32,
    pub base: u64,
    pub ien: bool,
    pub vector: u16,
    /// Head doorbell, as the guest last wrote it.
    pub head: u32,
    /// Next slot the controller writes.
    pub tail: u32,
    /// Phase tag of the current pass.
    pub phase: bool,
}

/// A submission queue.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct SqV1 {
    pub id: u16,
    pub size: u32,
    pub base: u64,
    pub cqid: u16,
    /// The next entry the controller fetches.
    pub head: u32,
    /// Tail doorbell, as the guest last wrote it.
    pub tail: u32,
    /// Completions of commands fetched and run that are not posted yet, in order.
    pub pending: Vec<CompletionV1>,
}

/// A completion not posted yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct CompletionV1 {
    pub result: u32,
    pub cid: u16,
    pub sct: u8,
    pub sc: u8,
    pub dnr: bool,
}

/// Upper bound of the encoded [`NvmeStateV1`] of a controller with `max_io_queues` I/O
/// queue pairs: every field at its largest varint, every queue present with
/// [`MAX_PENDING`] completions (the controller's `max_state_size`; a unit test encodes
/// that state and checks it fits).
pub fn max_encoded_size(max_io_queues: u16) -> u64 {
    let queues = u64::from(max_io_queues) + 1;
    // Header (format name, version), the fixed registers, features without the vector
    // table, the AER part, dbbuf, counters: generously.
    let fixed = 32 + 100 + 64 + 5 + MAX_AERS as u64 * 3 + 5 + MAX_EVENTS as u64 * 5 + 32 + 60;
    let vector_config = 5 + queues;
    let cq = 3 + 5 + 10 + 1 + 3 + 5 + 5 + 1;
    let completion = 5 + 3 + 2 + 2 + 1;
    let sq = 3 + 5 + 10 + 3 + 5 + 5 + 5 + MAX_PENDING as u64 * completion;
    fixed + vector_config + 5 + queues * cq + 5 + queues * sq
}

/// Read a [`NvmeStateV1`] field by field (see the module doc); the result is not checked
/// against the controller yet ([`NvmeStateV1::check`]). `max_io_queues` is the
/// destination's: it bounds the queue tables and the vector configuration.
pub fn decode_state_v1(bytes: &[u8], max_io_queues: u16) -> Result<NvmeStateV1, MigrationError> {
    let (_, mut d) = Decoder::new(STATE_FORMAT, STATE_VERSION_MIN, STATE_VERSION, bytes)?;
    let ids = usize::from(max_io_queues) + 1;
    let blocks = d.value()?;
    let src_max_io_queues = d.value()?;
    let max_queue_entries = d.value()?;
    let cc = d.value()?;
    let cc_enabled = d.value()?;
    let aqa = d.value()?;
    let asq = d.value()?;
    let acq = d.value()?;
    let csts = d.value()?;
    let intms = d.value()?;
    let features = FeaturesV1 {
        arbitration: d.value()?,
        power_state: d.value()?,
        temp_over: d.value()?,
        temp_under: d.value()?,
        error_recovery: d.value()?,
        write_cache: d.value()?,
        queues_granted: d.value()?,
        irq_coalescing: d.value()?,
        vector_config: {
            let n = d.seq_len(ids, 1)?;
            (0..n).map(|_| d.value()).collect::<Result<_, _>>()?
        },
        write_atomicity: d.value()?,
        async_event_config: d.value()?,
    };
    let n = d.seq_len(MAX_AERS, 1)?;
    let aer_outstanding = (0..n).map(|_| d.value()).collect::<Result<_, _>>()?;
    let n = d.seq_len(MAX_EVENTS, 1)?;
    let aer_events = (0..n).map(|_| d.value()).collect::<Result<_, _>>()?;
    let aer_masked = d.value()?;
    let dbbuf = d.value()?;
    let counters = d.value()?;
    let n = d.seq_len(ids, 8)?;
    let mut seen = vec![false; ids];
    let mut cqs = Vec::with_capacity(n);
    for _ in 0..n {
        let cq: CqV1 = d.value()?;
        first_time(&d, &mut seen, "completion", cq.id)?;
        cqs.push(cq);
    }
    let n = d.seq_len(ids, 7)?;
    let mut seen = vec![false; ids];
    let mut sqs = Vec::with_capacity(n);
    for _ in 0..n {
        let (id, size, base, cqid, head, tail) = d.value::<(u16, u32, u64, u16, u32, u32)>()?;
        first_time(&d, &mut seen, "submission", id)?;
        let k = d.seq_len(MAX_PENDING, 5)?;
        let pending = (0..k).map(|_| d.value()).collect::<Result<_, _>>()?;
        sqs.push(SqV1 {
            id,
            size,
            base,
            cqid,
            head,
            tail,
            pending,
        });
    }
    d.finish()?;
    Ok(NvmeStateV1 {
        blocks,
        max_io_queues: src_max_io_queues,
        max_queue_entries,
        cc,
        cc_enabled,
        aqa,
        asq,
        acq,
        csts,
        intms,
        features,
        aer_outstanding,
        aer_events,
        aer_masked,
        dbbuf,
        counters,
        cqs,
        sqs,
    })
}

/// Mark queue `id` seen; refuse an id out of range or seen before.
fn first_time(
    d: &Decoder<'_>,
    seen: &mut [bool],
    kind: &str,
    id: u16,
) -> Result<(), MigrationError> {
    match seen.get_mut(usize::from(id)) {
        None => Err(d.malformed(format!("{kind} queue {id}: no such queue id"))),
        Some(s) if *s => Err(d.malformed(format!("{kind} queue {id} twice"))),
        Some(s) => {
            *s = true;
            Ok(())
        }
    }
}

fn malformed(why: impl Into<String>) -> MigrationError {
    MigrationError::Malformed {
        format: STATE_FORMAT.to_owned(),
        why: why.into(),
    }
}

/// A ring of `size` entries of `entry` bytes at `base`: page aligned, not wrapping.
fn check_ring(
    what: &str,
    base: u64,
    size: u32,
    max: u32,
    entry: u64,
) -> Result<(), MigrationError> {
    if size < 2 || size > max {
        return Err(malformed(format!("{what}: size {size} (2 to {max})")));
    }
    if !base.is_multiple_of(4096) || base.checked_add(u64::from(size) * entry).is_none() {
        return Err(malformed(format!("{what}: base {base:#x}")));
    }
    Ok(())
}

impl NvmeStateV1 {
    /// Check the state against a controller with `limits` on a namespace of `blocks`:
    /// configuration equal, every register, feature and queue one such a controller can
    /// be in. Nothing is applied before this passes.
    pub fn check(&self, limits: &Limits, blocks: u64) -> Result<(), MigrationError> {
        let l = limits;
        if self.blocks != blocks {
            return Err(MigrationError::Incompatible(format!(
                "the state is of a {}-block namespace, this controller's image has {blocks} \
                 blocks (the destination must open the source's image)",
                self.blocks
            )));
        }
        if self.max_io_queues != l.max_io_queues || self.max_queue_entries != l.max_queue_entries {
            return Err(MigrationError::Incompatible(format!(
                "the state is of a controller with {} I/O queue pairs of up to {} entries, \
                 this one has {} of up to {}",
                self.max_io_queues, self.max_queue_entries, l.max_io_queues, l.max_queue_entries
            )));
        }
        let vectors = l.max_io_queues + 1;
        if self.aqa & !0x0fff_0fff != 0 {
            return Err(malformed(format!("AQA {:#x}", self.aqa)));
        }
        if self.csts & !(CSTS_RDY | CSTS_CFS | CSTS_SHST_MASK) != 0 {
            return Err(malformed(format!("CSTS {:#x}", self.csts)));
        }
        let f = &self.features;
        if f.vector_config.len() != usize::from(vectors) {
            return Err(malformed(format!(
                "{} interrupt vector configurations for {vectors} vectors",
                f.vector_config.len()
            )));
        }
        if let Some((sqs, cqs)) = f.queues_granted {
            if sqs >= l.max_io_queues || cqs >= l.max_io_queues {
                return Err(malformed(format!("{sqs}/{cqs} queues granted")));
            }
        }
        if self.aer_outstanding.len() > MAX_AERS || self.aer_events.len() > MAX_EVENTS {
            return Err(malformed("too many asynchronous events or requests"));
        }
        if let Some((shadow, ei)) = self.dbbuf {
            if !l.shadow_doorbells {
                return Err(MigrationError::Incompatible(
                    "the state uses shadow doorbells, this controller does not offer them".into(),
                ));
            }
            if shadow == 0
                || ei == 0
                || shadow == ei
                || !shadow.is_multiple_of(4096)
                || !ei.is_multiple_of(4096)
            {
                return Err(malformed("doorbell buffer addresses"));
            }
        }
        let mut cq_seen = vec![false; usize::from(vectors)];
        for cq in &self.cqs {
            let what = format!("completion queue {}", cq.id);
            let seen = cq_seen
                .get_mut(usize::from(cq.id))
                .ok_or_else(|| malformed(format!("{what}: no such queue")))?;
            if std::mem::replace(seen, true) {
                return Err(malformed(format!("{what} twice")));
            }
            let max = if cq.id == 0 {
                MAX_ADMIN_ENTRIES
            } else {
                l.max_queue_entries
            };
            check_ring(&what, cq.base, cq.size, max, 16)?;
            if cq.head >= cq.size || cq.tail >= cq.size || cq.vector >= vectors {
                return Err(malformed(format!("{what}: head, tail or vector")));
            }
            if cq.id == 0 && (cq.vector != 0 || !cq.ien) {
                return Err(malformed("the admin completion queue's interrupt"));
            }
        }
        let mut sq_seen = vec![false; usize::from(vectors)];
        for sq in &self.sqs {
            let what = format!("submission queue {}", sq.id);
            let seen = sq_seen
                .get_mut(usize::from(sq.id))
                .ok_or_else(|| malformed(format!("{what}: no such queue")))?;
            if std::mem::replace(seen, true) {
                return Err(malformed(format!("{what} twice")));
            }
            let max = if sq.id == 0 {
                MAX_ADMIN_ENTRIES
            } else {
                l.max_queue_entries
            };
            check_ring(&what, sq.base, sq.size, max, 64)?;
            if sq.head >= sq.size || sq.tail >= sq.size {
                return Err(malformed(format!("{what}: head or tail")));
            }
            let cq_ok = if sq.id == 0 {
                sq.cqid == 0
            } else {
                sq.cqid != 0 && cq_seen.get(usize::from(sq.cqid)) == Some(&true)
            };
            if !cq_ok {
                return Err(malformed(format!(
                    "{what}: on completion queue {}",
                    sq.cqid
                )));
            }
            if sq.pending.len() > MAX_PENDING {
                return Err(malformed(format!(
                    "{what}: {} completions pending",
                    sq.pending.len()
                )));
            }
        }
        let enabled = self.csts & CSTS_RDY != 0;
        if enabled != (cq_seen[0] && sq_seen[0]) {
            return Err(malformed("the admin queue and CSTS.RDY disagree"));
        }
        if !enabled && (!self.cqs.is_empty() || !self.sqs.is_empty()) {
            return Err(malformed("queues on a disabled controller"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use umdev::migration::encode_state;

    use super::*;

    fn largest(max_io_queues: u16) -> NvmeStateV1 {
        let ids = max_io_queues + 1;
        let completion = CompletionV1 {
            result: u32::MAX,
            cid: u16::MAX,
            sct: u8::MAX,
            sc: u8::MAX,
            dnr: true,
        };
        NvmeStateV1 {
            blocks: u64::MAX,
            max_io_queues,
            max_queue_entries: u32::MAX,
            cc: u32::MAX,
            cc_enabled: u32::MAX,
            aqa: u32::MAX,
            asq: u64::MAX,
            acq: u64::MAX,
            csts: u32::MAX,
            intms: u32::MAX,
            features: FeaturesV1 {
                arbitration: u32::MAX,
                power_state: u32::MAX,
                temp_over: u16::MAX,
                temp_under: u16::MAX,
                error_recovery: u32::MAX,
                write_cache: true,
                queues_granted: Some((u16::MAX, u16::MAX)),
                irq_coalescing: u32::MAX,
                vector_config: vec![true; usize::from(ids)],
                write_atomicity: u32::MAX,
                async_event_config: u32::MAX,
            },
            aer_outstanding: vec![u16::MAX; MAX_AERS],
            aer_events: vec![u32::MAX; MAX_EVENTS],
            aer_masked: u8::MAX,
            dbbuf: Some((u64::MAX, u64::MAX)),
            counters: [u64::MAX; 5],
            cqs: (0..ids)
                .map(|id| CqV1 {
                    id,
                    size: u32::MAX,
                    base: u64::MAX,
                    ien: true,
                    vector: u16::MAX,
                    head: u32::MAX,
                    tail: u32::MAX,
                    phase: true,
                })
                .collect(),
            sqs: (0..ids)
                .map(|id| SqV1 {
                    id,
                    size: u32::MAX,
                    base: u64::MAX,
                    cqid: u16::MAX,
                    head: u32::MAX,
                    tail: u32::MAX,
                    pending: vec![completion; MAX_PENDING],
                })
                .collect(),
        }
    }

    #[test]
    fn test_nvme_state_at_its_largest_fits_max_encoded_size_and_decodes_back() {
        for q in [1, 4, super::super::super::MAX_IO_QUEUES] {
            let s = largest(q);
            let bytes = encode_state(STATE_FORMAT, u32::MAX, &s).unwrap();
            assert!(
                bytes.len() as u64 <= max_encoded_size(q),
                "{q} queues: {} bytes > {}",
                bytes.len(),
                max_encoded_size(q)
            );
            let bytes = encode_state(STATE_FORMAT, STATE_VERSION, &s).unwrap();
            assert_eq!(decode_state_v1(&bytes, q).unwrap(), s);
        }
    }

    #[test]
    fn test_nvme_state_decoder_refuses_queue_twice_and_too_many_queues() {
        let mut s = largest(2);
        s.cqs[1].id = 0;
        let bytes = encode_state(STATE_FORMAT, STATE_VERSION, &s).unwrap();
        let e = decode_state_v1(&bytes, 2).unwrap_err().to_string();
        assert!(e.contains("twice"), "{e}");
        let bytes = encode_state(STATE_FORMAT, STATE_VERSION, &largest(4)).unwrap();
        assert!(decode_state_v1(&bytes, 2).is_err(), "5 queue ids into 3");
    }
}
