//! The legal arcs of the migration state machine and the path a SET takes through them.
//!
//! The direct arcs are the ones `linux/vfio.h` defines, less those through the P2P states
//! umdev never offers, less those through PRE_COPY when the device does not offer it:
//!
//! | from | to | what the framework does |
//! |---|---|---|
//! | RUNNING | STOP | [`Migrate::stop`](super::Migrate::stop) |
//! | STOP | RUNNING | [`Migrate::resume`](super::Migrate::resume) |
//! | STOP | STOP_COPY | [`Migrate::save`](super::Migrate::save): a saving session starts |
//! | STOP_COPY | STOP | the saving session ends |
//! | STOP | RESUMING | a resuming session starts |
//! | RESUMING | STOP | [`Migrate::load`](super::Migrate::load): the resuming session ends |
//! | RUNNING | PRE_COPY | a saving session starts; data from [`Migrate::precopy`](super::Migrate::precopy) |
//! | PRE_COPY | RUNNING | the saving session ends |
//! | PRE_COPY | STOP_COPY | stop, then save; the saving session goes on |
//!
//! Any other reachable target is a combination of these: the shortest path whose interior
//! states are not in the saving group (PRE_COPY, STOP_COPY), the rule of `linux/vfio.h`;
//! STOP_COPY → PRE_COPY is explicitly not allowed. [`next_state`] gives the first arc of
//! that path, as the kernel's `vfio_mig_get_next_state` does, so the machine walks it one
//! arc at a time. ERROR, the P2P states and (without PRE_COPY support) PRE_COPY are never
//! a valid target, and nothing leaves ERROR but a reset.
//!
//! The path is computed by a breadth-first search over the arcs above rather than read from
//! a copy of the kernel's table; the unit tests compare it with that table for every pair of
//! states, with and without PRE_COPY.

use std::collections::VecDeque;

use super::{MigState, MigrationCaps};

/// Every state, in wire order.
pub(crate) const ALL_STATES: [MigState; 8] = [
    MigState::Error,
    MigState::Stop,
    MigState::Running,
    MigState::StopCopy,
    MigState::Resuming,
    MigState::RunningP2p,
    MigState::PreCopy,
    MigState::PreCopyP2p,
];

/// True if `s` is a state the device can be in (ERROR included: it can be reported, never
/// requested).
pub fn is_offered(s: MigState, caps: MigrationCaps) -> bool {
    match s {
        MigState::Error
        | MigState::Stop
        | MigState::Running
        | MigState::StopCopy
        | MigState::Resuming => true,
        MigState::PreCopy => caps.pre_copy,
        MigState::RunningP2p | MigState::PreCopyP2p => false,
    }
}

/// True if `s` belongs to the saving group (its data transfer session is a saving one).
pub fn is_saving(s: MigState) -> bool {
    matches!(
        s,
        MigState::PreCopy | MigState::StopCopy | MigState::PreCopyP2p
    )
}

/// The direct arcs out of `from` for a device with `caps`.
fn arcs_from(from: MigState, caps: MigrationCaps) -> impl Iterator<Item = MigState> {
    let all: &[MigState] = match from {
        MigState::Running => &[MigState::Stop, MigState::PreCopy],
        MigState::Stop => &[MigState::Running, MigState::StopCopy, MigState::Resuming],
        MigState::StopCopy => &[MigState::Stop],
        MigState::Resuming => &[MigState::Stop],
        MigState::PreCopy => &[MigState::Running, MigState::StopCopy],
        MigState::Error | MigState::RunningP2p | MigState::PreCopyP2p => &[],
    };
    all.iter().copied().filter(move |&s| is_offered(s, caps))
}

/// Why a SET cannot reach its target.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ArcError {
    /// The target is not a state this device offers (ERROR, a P2P state, PRE_COPY without
    /// PRE_COPY support).
    #[error("{0:?} is not a state this device can be set to")]
    NotOffered(MigState),
    /// The device is in ERROR: only a reset leaves it.
    #[error("the device is in ERROR; only a reset leaves it")]
    InError,
    /// No legal path leads there (STOP_COPY → PRE_COPY).
    #[error("no legal path from {from:?} to {to:?}")]
    Unreachable {
        /// Current state.
        from: MigState,
        /// Requested state.
        to: MigState,
    },
}

/// The first arc of the path from `cur` to `target` (`target` itself for a direct arc,
/// `cur` when they are equal), or why there is none.
pub fn next_state(
    cur: MigState,
    target: MigState,
    caps: MigrationCaps,
) -> Result<MigState, ArcError> {
    if target == MigState::Error || !is_offered(target, caps) {
        return Err(ArcError::NotOffered(target));
    }
    if cur == MigState::Error {
        return Err(ArcError::InError);
    }
    if cur == target {
        return Ok(cur);
    }
    if cur == MigState::StopCopy && target == MigState::PreCopy {
        return Err(ArcError::Unreachable {
            from: cur,
            to: target,
        });
    }
    // Breadth-first from `cur`; a saving-group state is an end point only (it is entered,
    // never passed through), except `cur` itself, which starts the path.
    let mut first_arc: [Option<MigState>; 8] = [None; 8];
    let mut queue = VecDeque::new();
    queue.push_back(cur);
    while let Some(s) = queue.pop_front() {
        if s != cur && is_saving(s) {
            continue;
        }
        for n in arcs_from(s, caps) {
            if n == cur || first_arc[n as usize].is_some() {
                continue;
            }
            let first = if s == cur {
                n
            } else {
                first_arc[s as usize].unwrap_or(n)
            };
            if n == target {
                return Ok(first);
            }
            first_arc[n as usize] = Some(first);
            queue.push_back(n);
        }
    }
    Err(ArcError::Unreachable {
        from: cur,
        to: target,
    })
}

/// The whole path from `cur` to `target`, arc by arc (empty when they are equal).
pub fn path(
    cur: MigState,
    target: MigState,
    caps: MigrationCaps,
) -> Result<Vec<MigState>, ArcError> {
    // Refused targets are refused even when the device is already there (ERROR to ERROR).
    next_state(cur, target, caps)?;
    let mut out = Vec::new();
    let mut s = cur;
    while s != target {
        s = next_state(s, target, caps)?;
        out.push(s);
        if out.len() > ALL_STATES.len() {
            // Cannot happen (each step is a shortest-path step); a bound, not a hang.
            return Err(ArcError::Unreachable {
                from: cur,
                to: target,
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use MigState::*;

    /// The kernel's `vfio_from_fsm_table` (`drivers/vfio/vfio_main.c`) as data: row = from,
    /// column = to, in wire order (ERROR, STOP, RUNNING, STOP_COPY, RESUMING, RUNNING_P2P,
    /// PRE_COPY, PRE_COPY_P2P), with ERROR meaning "no path".
    const KERNEL_TABLE: [[MigState; 8]; 8] = [
        // from ERROR
        [Error, Error, Error, Error, Error, Error, Error, Error],
        // from STOP
        [
            Error, Stop, RunningP2p, StopCopy, Resuming, RunningP2p, RunningP2p, RunningP2p,
        ],
        // from RUNNING
        [
            Error, RunningP2p, Running, RunningP2p, RunningP2p, RunningP2p, PreCopy, RunningP2p,
        ],
        // from STOP_COPY
        [Error, Stop, Stop, StopCopy, Stop, Stop, Error, Error],
        // from RESUMING
        [Error, Stop, Stop, Stop, Resuming, Stop, Stop, Stop],
        // from RUNNING_P2P
        [
            Error, Stop, Running, Stop, Stop, RunningP2p, Running, PreCopyP2p,
        ],
        // from PRE_COPY
        [
            Error, Running, Running, PreCopyP2p, Running, Running, PreCopy, PreCopyP2p,
        ],
        // from PRE_COPY_P2P
        [
            Error, RunningP2p, RunningP2p, StopCopy, RunningP2p, RunningP2p, PreCopy, PreCopyP2p,
        ],
    ];

    /// The kernel's `vfio_mig_get_next_state` over [`KERNEL_TABLE`]: `None` for -EINVAL.
    fn kernel_next(cur: MigState, new: MigState, caps: MigrationCaps) -> Option<MigState> {
        let supported = |s: MigState| is_offered(s, caps);
        if !supported(cur) || !supported(new) {
            return None;
        }
        let mut next = KERNEL_TABLE[cur as usize][new as usize];
        while !supported(next) {
            next = KERNEL_TABLE[next as usize][new as usize];
        }
        (next != Error).then_some(next)
    }

    fn both_caps() -> [MigrationCaps; 2] {
        [
            MigrationCaps { pre_copy: false },
            MigrationCaps { pre_copy: true },
        ]
    }

    #[test]
    fn test_next_state_every_pair_matches_the_kernel_table() {
        for caps in both_caps() {
            for cur in ALL_STATES {
                for target in ALL_STATES {
                    let ours = next_state(cur, target, caps).ok();
                    // The kernel WARNs for an unsupported current state; umdev is never in
                    // one, so only offered current states are compared.
                    if !is_offered(cur, caps) {
                        continue;
                    }
                    assert_eq!(
                        ours,
                        kernel_next(cur, target, caps),
                        "{cur:?} -> {target:?} with {caps:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn test_path_blocked_and_unoffered_targets_are_errors() {
        let pre = MigrationCaps { pre_copy: true };
        let none = MigrationCaps { pre_copy: false };
        assert_eq!(
            next_state(StopCopy, PreCopy, pre),
            Err(ArcError::Unreachable {
                from: StopCopy,
                to: PreCopy
            })
        );
        assert_eq!(
            next_state(Running, PreCopy, none),
            Err(ArcError::NotOffered(PreCopy))
        );
        for p2p in [RunningP2p, PreCopyP2p] {
            assert_eq!(
                next_state(Running, p2p, pre),
                Err(ArcError::NotOffered(p2p))
            );
        }
        assert_eq!(
            next_state(Stop, Error, pre),
            Err(ArcError::NotOffered(Error))
        );
        assert_eq!(next_state(Error, Running, pre), Err(ArcError::InError));
        assert_eq!(path(Error, Error, pre), Err(ArcError::NotOffered(Error)));
    }

    #[test]
    fn test_path_combinations_take_the_shortest_legal_route() {
        let pre = MigrationCaps { pre_copy: true };
        assert_eq!(path(Running, StopCopy, pre).unwrap(), [Stop, StopCopy]);
        assert_eq!(path(PreCopy, Stop, pre).unwrap(), [Running, Stop]);
        assert_eq!(
            path(Resuming, PreCopy, pre).unwrap(),
            [Stop, Running, PreCopy]
        );
        assert_eq!(path(StopCopy, Running, pre).unwrap(), [Stop, Running]);
        assert_eq!(path(Running, Running, pre).unwrap(), []);
    }
}
