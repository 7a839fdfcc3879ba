//! Following processes: the kernel's fork, exec and exit events for the sessions that follow
//! them, and a sweep once a second that backstops exits the kernel could not report and
//! looks for Python processes that appeared.

use tracer_common::{ProcEvent, PROC_EVENT_EXEC, PROC_EVENT_EXIT, PROC_EVENT_FORK};
use tracer_proto::{target, EndReason};

use super::{Done, Manager};
use crate::session::python::watch::Met;
use tracer_inspect::process;

impl Manager {
    pub(super) fn on_proc_event(&mut self, ev: ProcEvent) {
        let mut ended = Vec::new();
        let mut execs = Vec::new();
        let mut crossed = Vec::new();
        let mut exited_sampled = false;
        let mut exec_sampled = false;
        for s in self.running.values_mut().filter(|s| s.follows_pid()) {
            let Some(slot) = s.slot else { continue };
            if ev.sessions & (1 << slot) == 0 {
                continue;
            }
            s.proc_events += 1;
            let is_target = s.target.kind == Some(target::Kind::Pid(ev.pid));
            let comm = || {
                let len = ev
                    .comm
                    .iter()
                    .position(|&b| b == 0)
                    .unwrap_or(ev.comm.len());
                String::from_utf8_lossy(&ev.comm[..len]).into_owned()
            };
            // The target's name: what it exec'd (a launched target is tracerctl before), else
            // what it was at exit. Exits come from the last thread, which may have another name.
            if is_target
                && (ev.kind == PROC_EVENT_EXEC
                    || (ev.kind == PROC_EVENT_EXIT && s.command.is_none()))
            {
                s.command = Some(comm());
            }
            if ev.kind == PROC_EVENT_EXEC {
                s.sources.each().for_each(|source| source.exec(ev.pid));
                exec_sampled |= s.samples();
            }
            match ev.kind {
                PROC_EVENT_FORK if s.live.insert(ev.pid) => {
                    s.followed += 1;
                    crate::container::note(ev.pid, true);
                }
                PROC_EVENT_EXIT => {
                    exited_sampled |= s.uses_sampler();
                    if s.live.remove(&ev.pid) {
                        s.exited += 1;
                        s.sources.each().for_each(|source| source.exited(ev.pid));
                    }
                    if s.live.is_empty() {
                        ended.push(s.id.clone());
                    }
                }
                // Held at exec (EXEC_HOLD): the new program has not run yet.
                PROC_EVENT_EXEC if s.owner_uid != 0 => {
                    match tracer_inspect::process::ptrace_boundary(ev.pid, s.owner_uid) {
                        Ok(Some(why)) => {
                            crossed.push((slot, why.clone()));
                            s.live.remove(&ev.pid);
                            s.unfollowed.push(format!(
                                "pid {} exec'd {}: {why}, so it is not traced, as the kernel would refuse ptrace",
                                ev.pid,
                                comm()
                            ));
                            if s.live.is_empty() {
                                ended.push(s.id.clone());
                            }
                        }
                        _ => execs.push(s.id.clone()),
                    }
                }
                PROC_EVENT_EXEC => execs.push(s.id.clone()),
                _ => {}
            }
        }
        for (slot, why) in crossed {
            if let Err(e) = self.bpf.unfollow(ev.pid, slot) {
                // Still followed: the process must not run on. It stays stopped; killing it
                // would change what the user ran.
                tracing::error!(%e, pid = ev.pid, %why, "cannot stop following a process that gained credentials; it stays stopped");
                self.kept_stopped.push(ev.pid);
                return;
            }
        }
        // Its new program, checked for the sessions that count Python there.
        let mut waits = ev.kind == PROC_EVENT_EXEC && !self.python_exec(ev.pid, ev.sessions, execs);
        if exec_sampled {
            // Held at its exec (EXEC_HOLD): its first samples find its interpreter read, even
            // for a process that lives a few milliseconds in a binary not seen before.
            waits = true;
            self.scans.sampled.push(ev.pid);
            let (looker, tx, pid) = (self.sampling.looker(), self.done.clone(), ev.pid);
            tokio::task::spawn_blocking(move || {
                looker.look(pid);
                let _ = tx.send(Done::SampledExec(pid));
            });
        }
        if ev.kind == PROC_EVENT_EXEC && !waits {
            // The probe stopped it if a Python session follows it (EXEC_HOLD). One whose new
            // interpreter is being probed off this task goes on once that is done.
            self.continue_held(ev.pid);
        }
        if exited_sampled {
            self.sampling.exited(ev.pid);
        }
        for id in ended {
            self.finish(&id, EndReason::TargetExited, None);
        }
    }

    /// A process held at its exec goes on once the sampler has read its new program, unless
    /// its interpreter is still being probed (then `recheck_late` continues it).
    pub(super) fn sampled_exec(&mut self, pid: u32) {
        self.scans.sampled.retain(|&p| p != pid);
        if !self.scans.holding(pid) {
            self.continue_held(pid);
        }
    }

    /// Backstop for exit events the kernel could not deliver (counted as losses): processes
    /// that are gone are treated as exited. Also continues processes left stopped at exec,
    /// and looks for Python processes that appeared.
    pub(super) fn sweep(&mut self) {
        self.continue_forgotten();
        let zeroed = tracer_inspect::sigbus::newly_zeroed();
        if zeroed > 0 {
            tracing::warn!(
                pages = zeroed,
                "files tracerd had mapped shrank under it (a traced user truncated a binary or \
                 counts file): those pages read as zeros, so names or counts taken from them \
                 may be wrong"
            );
        }
        let mut ended = Vec::new();
        for s in self
            .running
            .values_mut()
            .filter(|s| s.slot.is_some() && s.follows_pid())
        {
            let gone: Vec<u32> = s
                .live
                .iter()
                .copied()
                .filter(|&p| !process::alive(p))
                .collect();
            for pid in gone {
                s.live.remove(&pid);
                s.exited += 1;
                s.sources.each().for_each(|source| source.exited(pid));
            }
            if s.live.is_empty() {
                ended.push(s.id.clone());
            }
        }
        for id in ended {
            self.finish(&id, EndReason::TargetExited, None);
        }
        self.save_unsaved();
        self.python_sweep();
    }

    /// A process stays stopped at its exec only while its check waits for its interpreter's
    /// probes (`scans.late`), or when it gained credentials and could not be unfollowed
    /// (`kept_stopped`); one stopped at its mapping of a CUDA library, while the library's
    /// probes are on their way (`cuda_held`). One held long with none pending was lost track
    /// of (a bug, as the one fixed in `check_session_process`); it goes on rather than stay
    /// stopped for good. So does one whose reading for the sampler (`scans.sampled`) takes
    /// that long: its first samples may then lack its interpreter, which beats a program
    /// stopped for as long as a reading hangs.
    fn continue_forgotten(&mut self) {
        let held = self.bpf.held();
        // Gone from the map once they exit.
        self.kept_stopped
            .retain(|pid| held.iter().any(|&(h, _)| h == *pid));
        let pending: Vec<u32> = self
            .scans
            .late
            .iter()
            .filter(|l| l.met == Met::AtExec)
            .map(|l| l.pid)
            .chain(self.kept_stopped.iter().copied())
            .chain(self.cuda_held.iter().copied())
            .collect();
        let now = crate::clock::monotonic_ns();
        for pid in forgotten(&held, now, &pending) {
            tracing::warn!(
                pid,
                "a process stopped at its exec had no check pending for it; continued"
            );
            self.continue_held(pid);
        }
    }
}

/// Longest a process may stay stopped at its exec with no check pending for it. Its exec
/// event is handled within milliseconds; this is far beyond any queue of them.
const HELD_AT_MOST_NS: u64 = 10_000_000_000;

/// Of the processes stopped at exec (`held`: pid, when), those stopped longer than
/// `HELD_AT_MOST_NS` at `now` with no check `pending`.
fn forgotten(held: &[(u32, u64)], now: u64, pending: &[u32]) -> Vec<u32> {
    held.iter()
        .filter(|&&(pid, at)| now.saturating_sub(at) > HELD_AT_MOST_NS && !pending.contains(&pid))
        .map(|&(pid, _)| pid)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_long_holds_with_nothing_pending_are_forgotten() {
        let now = 100 * HELD_AT_MOST_NS;
        let held = [
            (1, now - 1),                   // just stopped
            (2, now - 2 * HELD_AT_MOST_NS), // stopped long ago, nothing pending
            (3, now - 2 * HELD_AT_MOST_NS), // stopped long ago, its probes on their way
            (4, now + 5),                   // stopped after `now` was read
            (5, now - HELD_AT_MOST_NS),     // exactly at the limit
        ];
        assert_eq!(forgotten(&held, now, &[3]), vec![2]);
        assert!(forgotten(&held, now, &[2, 3]).is_empty());
        assert!(forgotten(&[], now, &[]).is_empty());
    }
}
