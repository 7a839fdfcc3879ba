//! The event ring of an injection library's launch table (`tracer_common::launches::Event`):
//! each launch counted in-process for a tracing session, read here in order from where the
//! session started. The process wrote it: a reader takes at most a ring's worth a read, and
//! what it cannot trust (a place written over while read, an entry that is not a row) is
//! counted as lost, never guessed at.

use std::time::{Duration, Instant};

use tracer_common::launches::{self, state, WRITING};

use super::LaunchTable;

/// How long a claimed place may stay unpublished before it counts as lost: its writer was
/// stopped or killed mid-write.
const STUCK: Duration = Duration::from_secs(1);

/// One launch as read: when, on which thread and CPU, and the row it counted in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchEvent {
    pub start_ns: u64,
    pub tid: u32,
    pub cpu: u32,
    /// The table's entry (index) the launch was counted in.
    pub entry: u32,
}

/// Where a reader is in one table's ring.
#[derive(Debug)]
pub struct EventCursor {
    /// The next event's number.
    next: u64,
    /// Since when `next` has been claimed but not published.
    stuck: Option<(u64, Instant)>,
    /// Events lost so far: written over before they were read, or unreadable.
    pub lost: u64,
}

impl LaunchTable {
    /// A cursor at the ring's head: events from now on.
    pub fn events_from_now(&self) -> EventCursor {
        EventCursor {
            next: self.header().events,
            stuck: None,
            lost: 0,
        }
    }

    /// The events published since `at` read last, in order; `last`: the final read (the
    /// session ends), where a place still unpublished is lost rather than waited for.
    pub fn events(&self, at: &mut EventCursor, last: bool) -> Vec<LaunchEvent> {
        let head = self.header().events;
        let ring = launches::EVENTS as u64;
        if head < at.next {
            // Only a process that wrote its own header goes back: start again from there.
            at.next = head;
        }
        if head - at.next > ring {
            at.lost += head - ring - at.next;
            at.next = head - ring;
        }
        let mut out = Vec::with_capacity((head - at.next) as usize);
        while at.next < head {
            match self.event(at.next) {
                Place::Read(e) => out.push(e),
                Place::Lost => at.lost += 1,
                Place::NotYet => {
                    let since = match at.stuck {
                        Some((n, since)) if n == at.next => since,
                        _ => Instant::now(),
                    };
                    if !last && since.elapsed() < STUCK {
                        at.stuck = Some((at.next, since));
                        break;
                    }
                    at.lost += 1;
                }
            }
            at.next += 1;
        }
        out
    }

    /// Event `n`'s place, read as a seqlock: its number before and after the copy.
    fn event(&self, n: u64) -> Place {
        let i = n as usize & (launches::EVENTS - 1);
        // SAFETY: the ring is inside the mapping, `EVENTS` places from `RING_AT`.
        let (before, e, after) = unsafe {
            let p = self.ring().add(i);
            let seq = std::ptr::addr_of!((*p).seq);
            let before = seq.read_volatile();
            std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
            let e = p.read_volatile();
            std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
            (before, e, seq.read_volatile())
        };
        if before == WRITING || before < n + 1 {
            return Place::NotYet;
        }
        if before != n + 1 || after != before || !self.is_row(e.entry) {
            return Place::Lost;
        }
        Place::Read(LaunchEvent {
            start_ns: e.start_ns,
            tid: e.tid,
            cpu: e.cpu,
            entry: e.entry,
        })
    }

    /// The key of row `entry` (a published one).
    pub fn key_at(&self, entry: u32) -> Option<tracer_common::CudaLaunchKey> {
        if !self.is_row(entry) {
            return None;
        }
        std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
        // SAFETY: as in `entry_state`; the key was written before the state was published.
        Some(unsafe {
            std::ptr::addr_of!((*self.entries().add(entry as usize)).key).read_volatile()
        })
    }

    /// Whether `entry` is a published row of the table.
    fn is_row(&self, entry: u32) -> bool {
        (entry as usize) < launches::SLOTS && self.entry_state(entry as usize) == state::READY
    }

    fn entry_state(&self, i: usize) -> u32 {
        // SAFETY: entries follow the header, `SLOTS` of them, inside the mapping; `i` < SLOTS.
        unsafe { std::ptr::addr_of!((*self.entries().add(i)).state).read_volatile() }
    }
}

enum Place {
    Read(LaunchEvent),
    Lost,
    NotYet,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    use tracer_common::launches::{Entry, Event, Header};

    /// A table made as the library makes it, mapped writable here, and taken as tracerd takes it.
    struct Made {
        map: *mut u8,
        _fd: OwnedFd,
        table: LaunchTable,
    }

    fn made() -> Made {
        let name = std::ffi::CString::new(launches::MEMFD_NAME).unwrap();
        // SAFETY: plain calls on a file of our own.
        unsafe {
            let fd = libc::memfd_create(name.as_ptr(), libc::MFD_ALLOW_SEALING);
            assert!(fd >= 0);
            let fd = OwnedFd::from_raw_fd(fd);
            assert_eq!(libc::ftruncate(fd.as_raw_fd(), launches::BYTES as i64), 0);
            let p = libc::mmap(
                std::ptr::null_mut(),
                launches::BYTES,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            );
            assert_ne!(p, libc::MAP_FAILED);
            let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
            assert_eq!(libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals), 0);
            let h = p.cast::<Header>();
            (*h).version = launches::VERSION;
            (*h).slots = launches::SLOTS as u32;
            (*h).magic = launches::MAGIC;
            // Row 5 published.
            let e = p
                .cast::<u8>()
                .add(std::mem::size_of::<Header>())
                .cast::<Entry>()
                .add(5);
            (*e).key.func = 0xf00;
            (*e).state = state::READY;
            let table = LaunchTable::take(std::process::id(), fd.as_raw_fd()).unwrap();
            Made {
                map: p.cast(),
                _fd: fd,
                table,
            }
        }
    }

    impl Made {
        /// Claims the next place and writes it (published unless `publish` is false).
        fn write(&self, entry: u32, start_ns: u64, publish: bool) -> u64 {
            // SAFETY: our writable mapping of the table.
            unsafe {
                let h = self.map.cast::<Header>();
                let n = (*h).events;
                (*h).events = n + 1;
                let p = self
                    .map
                    .add(launches::RING_AT)
                    .cast::<Event>()
                    .add(n as usize & (launches::EVENTS - 1));
                *p = Event {
                    seq: if publish { n + 1 } else { WRITING },
                    start_ns,
                    tid: 7,
                    cpu: 1,
                    entry,
                    _pad: 0,
                };
                n
            }
        }
    }

    #[test]
    fn events_are_read_in_order_once_and_what_cannot_be_trusted_is_lost() {
        let m = made();
        m.write(5, 1, true);
        let mut at = m.table.events_from_now();
        assert!(m.table.events(&mut at, false).is_empty(), "from now on");
        m.write(5, 2, true);
        m.write(6, 3, true); // not a row
        m.write(5, 4, true);
        let got = m.table.events(&mut at, false);
        assert_eq!(got.iter().map(|e| e.start_ns).collect::<Vec<_>>(), [2, 4]);
        assert_eq!((got[0].tid, got[0].cpu, got[0].entry), (7, 1, 5));
        assert_eq!(at.lost, 1);
        assert_eq!(m.table.key_at(5).map(|k| k.func), Some(0xf00));
        assert_eq!(m.table.key_at(6), None);
        // A place claimed but not yet written holds back what follows, until the end.
        m.write(5, 5, false);
        m.write(5, 6, true);
        assert!(m.table.events(&mut at, false).is_empty());
        let got = m.table.events(&mut at, true);
        assert_eq!(got.iter().map(|e| e.start_ns).collect::<Vec<_>>(), [6]);
        assert_eq!(at.lost, 2);
        // A reader a whole ring behind loses what was written over, and no more.
        for i in 0..launches::EVENTS as u64 + 10 {
            m.write(5, 100 + i, true);
        }
        let got = m.table.events(&mut at, false);
        assert_eq!(got.len(), launches::EVENTS);
        assert_eq!(got[0].start_ns, 110);
        assert_eq!(at.lost, 12);
    }
}
