//! Handlers of the migration messages: DEVICE_FEATURE MIGRATION and MIG_DEVICE_STATE,
//! MIG_DATA_READ/WRITE, and what DEVICE_RESET and a disconnect do to a migration.
//!
//! The connection owns the [`Machine`] (one per connection, RUNNING when the client
//! connects) and, while the device is stopped, a [`RequestHold`]: it is taken just before
//! [`Migrate::stop`](crate::migration::Migrate::stop) runs and kept until the device runs
//! again (just before `resume`, or after a reset or disconnect resumed it). Why keep it
//! that long, not only around `stop`:
//! - `stop` may wait for a device thread that waits for the client (DMA to fd-less memory);
//!   cancelling pending requests is what lets it return before the client's timeout.
//! - After STOP the device must not DMA. A thread that tries anyway through the client
//!   (fd-less memory) gets `ECANCELED` instead of reaching a client that is copying guest
//!   memory and expects the device to be quiet; a STOP_COPY or RESUMING session never
//!   waits behind such a request either. (DMA to fd-backed memory does not go through the
//!   client and cannot be refused here: a device that keeps writing there after `stop` is
//!   a device bug, which the poisoned-memory test of `framework/tests/migration_*.rs`
//!   catches.)
//!
//! A reset with the device stopped resumes it after the device's reset, so the device runs
//! again in RUNNING as the spec says; a disconnect does the same (the next client finds a
//! running device, and device state is otherwise kept, as for any disconnect).

use tracing::{debug, info, warn};

use super::connection::{lock_device, Connection, Reply};
use super::ServerError;
use crate::migration::{Machine, MachineError, MigState, Quiesce};
use crate::protocol::feature::FeatureRequest;
use crate::protocol::migration::{
    encode_mig_state_reply, encode_migration_reply, migration_flags, put_mig_data_reply, MigData,
    MIG_DATA_HEADER_SIZE,
};
use crate::protocol::ProtocolError;

/// The request's flags word (bytes 4..8 of a DEVICE_FEATURE payload, checked by decode).
fn request_flags(payload: &[u8]) -> u32 {
    payload
        .get(4..8)
        .and_then(|b| <[u8; 4]>::try_from(b).ok())
        .map_or(0, u32::from_ne_bytes)
}

impl Connection {
    /// A migration feature (MIGRATION, MIG_DEVICE_STATE, or a PROBE of either).
    pub(super) fn migration_feature(
        &mut self,
        f: FeatureRequest,
        payload: &[u8],
    ) -> Result<Reply, ServerError> {
        let flags = request_flags(payload);
        let Some(machine) = self.migration.as_mut() else {
            return Err(ServerError::NoMigration);
        };
        match f {
            FeatureRequest::Migration => Ok(Reply::from_payload(&encode_migration_reply(
                flags,
                migration_flags(machine.caps()),
            ))),
            FeatureRequest::MigStateGet => Ok(Reply::from_payload(&encode_mig_state_reply(
                flags,
                machine.state(),
            ))),
            FeatureRequest::MigStateSet(target) => {
                let from = machine.state();
                let chan = &self.chan;
                let hold = &mut self.mig_hold;
                let mut quiesce = |q: Quiesce| match q {
                    Quiesce::Stopping => {
                        if hold.is_none() {
                            *hold = Some(chan.hold_requests("the device is stopped for migration"));
                        }
                    }
                    Quiesce::Running => *hold = None,
                };
                let mut dev = lock_device(&self.device);
                let Some(m) = dev.migration() else {
                    return Err(ServerError::NoMigration);
                };
                let r = machine.set_state(target, m, &mut quiesce);
                drop(dev);
                r.map_err(ServerError::Migration)?;
                info!(from = ?from, to = ?target, "migration state set");
                Ok(Reply::from_payload(&encode_mig_state_reply(
                    flags,
                    machine.state(),
                )))
            }
            // Probe, and whatever else: the feature is supported, echo.
            _ => Ok(Reply::from_payload(payload)),
        }
    }

    /// MIG_DATA_READ / MIG_DATA_WRITE.
    pub(super) fn mig_data(&mut self, d: MigData<'_>) -> Result<Reply, ServerError> {
        let Some(machine) = self.migration.as_mut() else {
            return Err(ServerError::NoMigration);
        };
        let mut dev = lock_device(&self.device);
        let Some(m) = dev.migration() else {
            return Err(ServerError::NoMigration);
        };
        match d {
            MigData::Read { size } => {
                // The reply carries the data: the client's limit applies too (the decoder
                // checked umdev's own).
                let max = self.chan.max_xfer();
                if size > max {
                    return Err(ProtocolError::TransferTooLarge {
                        count: u64::from(size),
                        max: u64::from(max),
                    }
                    .into());
                }
                let data = machine
                    .read(size as usize, m)
                    .map_err(ServerError::Migration)?;
                debug!(asked = size, got = data.len(), "MIG_DATA_READ");
                let mut reply = Reply::with_capacity(MIG_DATA_HEADER_SIZE + size as usize);
                put_mig_data_reply(reply.buf_mut(), &data, size);
                Ok(reply)
            }
            MigData::Write(data) => {
                machine.write(data, m).map_err(ServerError::Migration)?;
                debug!(size = data.len(), "MIG_DATA_WRITE");
                Ok(Reply::empty())
            }
        }
    }

    /// After the device's reset (DEVICE_RESET): resume a stopped device, back to RUNNING,
    /// the hold released. A device that fails to resume leaves the machine in ERROR.
    pub(super) fn migration_after_reset(&mut self) -> Result<(), ServerError> {
        let Some(machine) = self.migration.as_mut() else {
            return Ok(());
        };
        let resumed = if machine.device_stopped() {
            let mut dev = lock_device(&self.device);
            match dev.migration().map(|m| m.resume()) {
                Some(Ok(())) => true,
                Some(Err(source)) => {
                    machine.reset(false);
                    return Err(ServerError::Migration(MachineError::ArcFailed {
                        from: MigState::Stop,
                        to: MigState::Running,
                        source,
                    }));
                }
                None => false,
            }
        } else {
            false
        };
        machine.reset(resumed);
        if machine.state() == MigState::Running {
            self.mig_hold = None;
        }
        debug!(resumed, "migration state RUNNING after reset");
        Ok(())
    }

    /// The client went away: a stopped device runs again (as after a reset); the session
    /// and the hold are dropped.
    pub(super) fn migration_teardown(&mut self) {
        let Some(machine) = self.migration.as_mut() else {
            return;
        };
        if machine.state() != MigState::Running {
            info!(state = ?machine.state(), "client left during a migration; the session is dropped");
        }
        if machine.device_stopped() {
            let mut dev = lock_device(&self.device);
            if let Some(Err(e)) = dev.migration().map(|m| m.resume()) {
                warn!(error = %e, "resuming the device after the client left failed");
            }
        }
        *machine = Machine::new(machine.caps());
        self.mig_hold = None;
    }
}
