//! Admin commands (NVMe 1.4 section 5), run on the admin queue's worker thread: one at a
//! time, so queue creation and deletion never race with each other.
//!
//! Every field is the guest's: each is checked and a bad one completes with the status the
//! spec gives it (Invalid Queue Identifier, Invalid Queue Size, Completion Queue Invalid,
//! Invalid Interrupt Vector, Invalid Field in Command, Invalid Log Page, ...), never a
//! panic. Asynchronous Event Requests are held ([`Outcome::Deferred`]) until an event
//! arrives ([`super::worker`] posts them).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::ctrl::{Features, Shared};
use super::identify;
use super::queues::{lock, Cq, QueueParams, Sq};
use super::regs::Cc;
use super::spec::{admin_op, feature, log_page, Command, Status};
use super::worker::{self, send_data, Outcome};

/// Run admin command `cmd` fetched from the admin queue `sq`.
pub fn execute(shared: &Arc<Shared>, sq: &Sq, cmd: &Command) -> Outcome {
    if cmd.fuse() != 0 || cmd.psdt() != 0 {
        return Outcome::err(Status::INVALID_FIELD);
    }
    match cmd.opcode {
        admin_op::CREATE_CQ => create_cq(shared, cmd),
        admin_op::CREATE_SQ => create_sq(shared, cmd),
        admin_op::DELETE_SQ => delete_sq(shared, cmd),
        admin_op::DELETE_CQ => delete_cq(shared, cmd),
        admin_op::IDENTIFY => identify(shared, sq, cmd),
        admin_op::GET_FEATURES => get_features(shared, cmd),
        admin_op::SET_FEATURES => set_features(shared, cmd),
        admin_op::GET_LOG_PAGE => get_log_page(shared, sq, cmd),
        admin_op::ABORT => Outcome::ok(1), // bit 0: the command was not aborted
        admin_op::ASYNC_EVENT => {
            let mut aer = lock(&shared.aer);
            if aer.outstanding.len() > usize::from(identify::AERL) {
                return Outcome::err(Status::AER_LIMIT);
            }
            aer.outstanding.push(cmd.cid);
            Outcome::Deferred
        }
        admin_op::KEEP_ALIVE => Outcome::ok(0),
        admin_op::DBBUF_CONFIG if shared.limits.shadow_doorbells => dbbuf_config(shared, cmd),
        op => {
            tracing::debug!(op, "nvme: unsupported admin opcode");
            Outcome::err(Status::INVALID_OPCODE)
        }
    }
}

/// Decoded CDW10 of Create/Delete queue commands: (queue id, entries).
fn qid_size(cmd: &Command) -> (u16, u32) {
    let dw10 = cmd.dw(10);
    ((dw10 & 0xffff) as u16, (dw10 >> 16) + 1)
}

/// Highest I/O queue id the guest may create.
fn max_qid(shared: &Shared, sq: bool) -> u16 {
    let granted = lock(&shared.features).queues_granted;
    match granted {
        Some((nsq, ncq)) => (if sq { nsq } else { ncq }) + 1,
        None => shared.limits.max_io_queues,
    }
}

/// Checks common to both creations; the ring must be page aligned and not wrap.
fn check_ring(shared: &Shared, cmd: &Command, sq: bool) -> Result<QueueParams, Status> {
    let (id, size) = qid_size(cmd);
    if id == 0 || id > max_qid(shared, sq) {
        return Err(Status::INVALID_QID);
    }
    if size < 2 || size > shared.limits.max_queue_entries {
        return Err(Status::INVALID_QUEUE_SIZE);
    }
    if cmd.dw(11) & 1 == 0 {
        // CAP.CQR = 1: only physically contiguous queues.
        return Err(Status::INVALID_FIELD);
    }
    if !cmd.prp1.is_multiple_of(4096) {
        return Err(Status::PRP_OFFSET_INVALID);
    }
    let entry = if sq { 64 } else { 16 };
    if cmd.prp1.checked_add(u64::from(size) * entry).is_none() {
        return Err(Status::INVALID_FIELD);
    }
    Ok(QueueParams {
        id,
        size,
        base: cmd.prp1,
    })
}

fn create_cq(shared: &Arc<Shared>, cmd: &Command) -> Outcome {
    let params = match check_ring(shared, cmd, false) {
        Ok(p) => p,
        Err(s) => return Outcome::err(s),
    };
    if Cc(shared.cc.load(Ordering::SeqCst)).iocqes() != 4 {
        return Outcome::err(Status::INVALID_FIELD);
    }
    let dw11 = cmd.dw(11);
    let ien = dw11 & 2 != 0;
    let vector = (dw11 >> 16) as u16;
    if vector >= shared.vectors() {
        return Outcome::err(Status::INVALID_VECTOR);
    }
    let Some(slot) = shared.cqs.get(usize::from(params.id)) else {
        return Outcome::err(Status::INVALID_QID);
    };
    let mut slot = slot.write().unwrap_or_else(|e| e.into_inner());
    if slot.is_some() {
        return Outcome::err(Status::INVALID_QID);
    }
    let cq = Arc::new(Cq::new(shared.dma.clone(), params, ien, vector));
    if let Some(db) = lock(&shared.dbbuf).clone() {
        if db.init_queue(params.id, None, Some(0)).is_err() {
            return Outcome::err(Status::DATA_TRANSFER_ERROR);
        }
        let _ = cq.dbbuf.set(db);
    }
    *slot = Some(cq);
    tracing::debug!(
        qid = params.id,
        size = params.size,
        vector,
        "nvme: I/O CQ created"
    );
    Outcome::ok(0)
}

fn create_sq(shared: &Arc<Shared>, cmd: &Command) -> Outcome {
    let params = match check_ring(shared, cmd, true) {
        Ok(p) => p,
        Err(s) => return Outcome::err(s),
    };
    if Cc(shared.cc.load(Ordering::SeqCst)).iosqes() != 6 {
        return Outcome::err(Status::INVALID_FIELD);
    }
    let cqid = (cmd.dw(11) >> 16) as u16;
    let Some(cq) = (cqid != 0).then(|| shared.cq(cqid)).flatten() else {
        return Outcome::err(Status::CQ_INVALID);
    };
    let Some(slot) = shared.sqs.get(usize::from(params.id)) else {
        return Outcome::err(Status::INVALID_QID);
    };
    let mut slot = slot.write().unwrap_or_else(|e| e.into_inner());
    if slot.is_some() {
        return Outcome::err(Status::INVALID_QID);
    }
    let sq = Arc::new(Sq::new(shared.dma.clone(), params, cqid));
    if let Some(db) = lock(&shared.dbbuf).clone() {
        if db.init_queue(params.id, Some(0), None).is_err() {
            return Outcome::err(Status::DATA_TRANSFER_ERROR);
        }
        let _ = sq.dbbuf.set(db);
    }
    match worker::spawn(shared.clone(), sq, cq) {
        Ok(s) => *slot = Some(s),
        Err(e) => {
            tracing::error!(error = %e, "nvme: cannot start a queue worker");
            return Outcome::err(Status::INTERNAL_ERROR);
        }
    }
    tracing::debug!(
        qid = params.id,
        size = params.size,
        cqid,
        "nvme: I/O SQ created"
    );
    Outcome::ok(0)
}

fn delete_sq(shared: &Shared, cmd: &Command) -> Outcome {
    let (id, _) = qid_size(cmd);
    let taken = match (id != 0).then(|| shared.sqs.get(usize::from(id))).flatten() {
        Some(slot) => slot.write().unwrap_or_else(|e| e.into_inner()).take(),
        None => None,
    };
    match taken {
        Some(s) => {
            // Outside the slot's lock: the worker finishes its command first.
            s.stop();
            Outcome::ok(0)
        }
        None => Outcome::err(Status::INVALID_QID),
    }
}

fn delete_cq(shared: &Shared, cmd: &Command) -> Outcome {
    let (id, _) = qid_size(cmd);
    let Some(slot) = (id != 0).then(|| shared.cqs.get(usize::from(id))).flatten() else {
        return Outcome::err(Status::INVALID_QID);
    };
    let in_use = (1..shared.sqs.len() as u16)
        .filter_map(|q| shared.sq(q))
        .any(|s| s.sq.cqid == id);
    let mut slot = slot.write().unwrap_or_else(|e| e.into_inner());
    if slot.is_none() {
        return Outcome::err(Status::INVALID_QID);
    }
    if in_use {
        return Outcome::err(Status::INVALID_QUEUE_DELETION);
    }
    *slot = None;
    Outcome::ok(0)
}

fn identify(shared: &Shared, sq: &Sq, cmd: &Command) -> Outcome {
    let cns = cmd.dw(10) & 0xff;
    let csi = cmd.dw(11) >> 24;
    let data = match cns {
        0x00 if cmd.nsid == 1 => identify::namespace(shared),
        0x03 if cmd.nsid == 1 => identify::descriptors(&shared.limits),
        0x00 | 0x03 => return Outcome::err(Status::INVALID_NAMESPACE),
        0x01 => identify::controller(
            &shared.limits,
            if shared.limits.shadow_doorbells {
                identify::OACS_DBBUF
            } else {
                0
            },
        ),
        0x02 if cmd.nsid < 0xffff_fffe => identify::active_list(cmd.nsid),
        0x02 => return Outcome::err(Status::INVALID_NAMESPACE),
        // I/O Command Set specific Identify Controller, NVM command set: no limits.
        0x06 if csi == 0 => vec![0; identify::IDENTIFY_SIZE],
        _ => return Outcome::err(Status::INVALID_FIELD),
    };
    Outcome::from_status(send_data(shared, sq, cmd, &data), 0)
}

/// Features with values; `None` for an unsupported identifier.
fn feature_value(f: &Features, limits_max: u16, fid: u8, dw11: u32) -> Option<Result<u32, Status>> {
    Some(Ok(match fid {
        feature::ARBITRATION => f.arbitration,
        feature::POWER_MGMT => f.power_state,
        feature::TEMP_THRESHOLD => {
            if (dw11 >> 16) & 0xf != 0 {
                return Some(Err(Status::INVALID_FIELD));
            }
            match (dw11 >> 20) & 3 {
                0 => u32::from(f.temp_over),
                1 => u32::from(f.temp_under),
                _ => return Some(Err(Status::INVALID_FIELD)),
            }
        }
        feature::ERROR_RECOVERY => f.error_recovery,
        feature::VOLATILE_WC => u32::from(f.write_cache),
        feature::NUM_QUEUES => {
            let (s, c) = f.queues_granted.unwrap_or((limits_max - 1, limits_max - 1));
            u32::from(s) | u32::from(c) << 16
        }
        feature::IRQ_COALESCING => f.irq_coalescing,
        feature::IRQ_VECTOR_CONFIG => {
            let iv = dw11 & 0xffff;
            match f.vector_config.get(iv as usize) {
                Some(&cd) => iv | u32::from(cd) << 16,
                None => return Some(Err(Status::INVALID_FIELD)),
            }
        }
        feature::WRITE_ATOMICITY => f.write_atomicity,
        feature::ASYNC_EVENT_CONFIG => f.async_event_config,
        _ => return None,
    }))
}

fn get_features(shared: &Shared, cmd: &Command) -> Outcome {
    let dw10 = cmd.dw(10);
    let fid = (dw10 & 0xff) as u8;
    let sel = (dw10 >> 8) & 7;
    let max = shared.limits.max_io_queues;
    let defaults;
    let current = lock(&shared.features);
    let f = match sel {
        0 => &*current,
        1..=3 => {
            defaults = Features::defaults(usize::from(shared.vectors()));
            &defaults
        }
        _ => return Outcome::err(Status::INVALID_FIELD),
    };
    match feature_value(f, max, fid, cmd.dw(11)) {
        None => Outcome::err(Status::INVALID_FIELD),
        // Supported capabilities: changeable, not saveable, not namespace specific.
        Some(Ok(_)) if sel == 3 => Outcome::ok(0x4),
        Some(Ok(v)) => Outcome::ok(v),
        Some(Err(s)) => Outcome::err(s),
    }
}

fn set_features(shared: &Shared, cmd: &Command) -> Outcome {
    let dw10 = cmd.dw(10);
    let dw11 = cmd.dw(11);
    let fid = (dw10 & 0xff) as u8;
    if dw10 >> 31 != 0 {
        return Outcome::err(Status::FEATURE_NOT_SAVEABLE);
    }
    let io_queues_exist =
        (1..shared.sqs.len() as u16).any(|q| shared.sq(q).is_some() || shared.cq(q).is_some());
    let mut f = lock(&shared.features);
    let result = match fid {
        feature::ARBITRATION => {
            f.arbitration = dw11;
            0
        }
        feature::POWER_MGMT => {
            if dw11 & 0x1f != 0 {
                return Outcome::err(Status::INVALID_FIELD);
            }
            f.power_state = dw11 & 0xff;
            0
        }
        feature::TEMP_THRESHOLD => {
            if (dw11 >> 16) & 0xf != 0 {
                return Outcome::err(Status::INVALID_FIELD);
            }
            match (dw11 >> 20) & 3 {
                0 => f.temp_over = dw11 as u16,
                1 => f.temp_under = dw11 as u16,
                _ => return Outcome::err(Status::INVALID_FIELD),
            }
            0
        }
        feature::ERROR_RECOVERY => {
            if dw11 & (1 << 16) != 0 {
                // DULBE: no deallocated-block errors here.
                return Outcome::err(Status::INVALID_FIELD);
            }
            f.error_recovery = dw11 & 0xffff;
            0
        }
        feature::VOLATILE_WC => {
            f.write_cache = dw11 & 1 != 0;
            0
        }
        feature::NUM_QUEUES => {
            let (nsqr, ncqr) = ((dw11 & 0xffff) as u16, (dw11 >> 16) as u16);
            if nsqr == 0xffff || ncqr == 0xffff {
                return Outcome::err(Status::INVALID_FIELD);
            }
            if io_queues_exist {
                // Command Sequence Error: only before any I/O queue exists.
                return Outcome::err(Status {
                    sct: 0,
                    sc: 0x0c,
                    dnr: true,
                });
            }
            let top = shared.limits.max_io_queues - 1;
            let granted = (nsqr.min(top), ncqr.min(top));
            f.queues_granted = Some(granted);
            u32::from(granted.0) | u32::from(granted.1) << 16
        }
        feature::IRQ_COALESCING => {
            f.irq_coalescing = dw11 & 0xffff;
            0
        }
        feature::IRQ_VECTOR_CONFIG => {
            let iv = (dw11 & 0xffff) as usize;
            match f.vector_config.get_mut(iv) {
                Some(cd) => *cd = dw11 & (1 << 16) != 0,
                None => return Outcome::err(Status::INVALID_FIELD),
            }
            0
        }
        feature::WRITE_ATOMICITY => {
            f.write_atomicity = dw11 & 1;
            0
        }
        feature::ASYNC_EVENT_CONFIG => {
            f.async_event_config = dw11;
            0
        }
        _ => return Outcome::err(Status::INVALID_FIELD),
    };
    Outcome::ok(result)
}

fn get_log_page(shared: &Shared, sq: &Sq, cmd: &Command) -> Outcome {
    let dw10 = cmd.dw(10);
    let lid = (dw10 & 0xff) as u8;
    let rae = dw10 & (1 << 15) != 0;
    let dwords = (u64::from(cmd.dw(11) & 0xffff) << 16 | u64::from(dw10 >> 16)) + 1;
    let len = dwords * 4;
    let offset = u64::from(cmd.dw(12)) | u64::from(cmd.dw(13)) << 32;
    if offset % 4 != 0 || len > shared.limits.max_transfer() {
        return Outcome::err(Status::INVALID_FIELD);
    }
    let (page, kind) = match lid {
        log_page::ERROR => (identify::error_log(), Some(0)),
        log_page::SMART => (identify::smart_log(shared), Some(1)),
        log_page::FW_SLOT => (identify::firmware_log(), None),
        _ => return Outcome::err(Status::INVALID_LOG_PAGE),
    };
    if offset > page.len() as u64 {
        return Outcome::err(Status::INVALID_FIELD);
    }
    let mut data = page[offset as usize..].to_vec();
    data.resize(len as usize, 0);
    let status = send_data(shared, sq, cmd, &data);
    if let (true, false, Some(k)) = (status.is_success(), rae, kind) {
        lock(&shared.aer).masked &= !(1u8 << k);
    }
    Outcome::from_status(status, 0)
}

/// Doorbell Buffer Config: PRP1 is the shadow doorbell page, PRP2 the EventIdx page. The
/// I/O queues that exist switch to it now (their current tail and head written into it),
/// later ones at creation; the admin queue keeps its registers, as Linux expects.
fn dbbuf_config(shared: &Shared, cmd: &Command) -> Outcome {
    let (shadow, ei) = (cmd.prp1, cmd.prp2);
    if shadow == 0
        || ei == 0
        || !shadow.is_multiple_of(4096)
        || !ei.is_multiple_of(4096)
        || shadow == ei
    {
        return Outcome::err(Status::INVALID_FIELD);
    }
    let mut current = lock(&shared.dbbuf);
    if current.is_some() {
        // Command Sequence Error: configured once per controller reset.
        return Outcome::err(Status {
            sct: 0,
            sc: 0x0c,
            dnr: true,
        });
    }
    let db = Arc::new(super::dbbuf::DbBuf::new(&shared.dma, shadow, ei));
    for q in 1..shared.sqs.len() as u16 {
        let sq = shared.sq(q);
        let cq = shared.cq(q);
        let tail = sq.as_ref().map(|s| s.sq.tail.load(Ordering::SeqCst));
        let head = cq.as_ref().map(|c| c.head.load(Ordering::SeqCst));
        if let Err(e) = db.init_queue(q, tail, head) {
            tracing::warn!("nvme: doorbell buffer unreachable: {e}");
            return Outcome::err(Status::DATA_TRANSFER_ERROR);
        }
        if let Some(s) = sq {
            let _ = s.sq.dbbuf.set(db.clone());
            let _ = s.wake.try_send(());
        }
        if let Some(c) = cq {
            let _ = c.dbbuf.set(db.clone());
        }
    }
    *current = Some(db);
    tracing::info!(shadow, eventidx = ei, "nvme: shadow doorbells configured");
    Outcome::ok(0)
}
