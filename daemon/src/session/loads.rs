//! Loads into other processes in flight: a start that loads tracer's code into a running
//! process (ptrace on 3.10–3.13, PEP 768 on 3.14+, CUDA's injection library for GPU times)
//! holds a blocking thread while it waits for a safe point and for the call, seconds at
//! most. A few at once per user and a few more in all; the rest are refused at once
//! (`RESOURCE_EXHAUSTED`), so no user's hung targets can hold up anybody's starts, interim
//! reports or closings, which share that pool of threads.

use std::{
    collections::HashMap,
    sync::{LazyLock, Mutex},
};

/// Loads one user may have in flight.
pub const PER_USER: usize = 4;
/// Loads all users may have in flight.
pub const IN_ALL: usize = 16;

/// Loads refused for want of a place since tracerd started.
static BUSY: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Loads refused for want of a place since tracerd started (its metrics).
pub fn refused() -> u64 {
    BUSY.load(std::sync::atomic::Ordering::Relaxed)
}

/// Loads in flight: in all, and per user.
static IN_FLIGHT: LazyLock<Mutex<(usize, HashMap<u32, usize>)>> = LazyLock::new(Mutex::default);

/// One load in flight, counted until dropped.
#[derive(Debug)]
pub struct Ticket {
    uid: u32,
}

impl Ticket {
    /// A place for a load made for `uid`, or why there is none now.
    pub fn take(uid: u32) -> Result<Self, String> {
        let mut guard = IN_FLIGHT.lock().unwrap_or_else(|e| e.into_inner());
        let (all, users) = &mut *guard;
        let mine = users.entry(uid).or_default();
        if *mine >= PER_USER || *all >= IN_ALL {
            BUSY.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        if *mine >= PER_USER {
            return Err(format!(
                "uid {uid} has {PER_USER} loads into processes in flight already (each ends within seconds): try again"
            ));
        }
        if *all >= IN_ALL {
            return Err(format!(
                "{IN_ALL} loads into processes are in flight already (each ends within seconds): try again"
            ));
        }
        *mine += 1;
        *all += 1;
        Ok(Self { uid })
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut guard = IN_FLIGHT.lock().unwrap_or_else(|e| e.into_inner());
        let (all, users) = &mut *guard;
        *all = all.saturating_sub(1);
        if let Some(n) = users.get_mut(&self.uid) {
            *n -= 1;
            if *n == 0 {
                users.remove(&self.uid);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One test owns the counts (tests run on threads of one process): uids no other test uses.
    #[test]
    fn a_user_and_all_users_are_bounded_and_places_come_back() {
        let first: Vec<Ticket> = (0..PER_USER)
            .map(|_| Ticket::take(4_000_001).unwrap())
            .collect();
        let busy = super::refused();
        let refused = Ticket::take(4_000_001).unwrap_err();
        assert!(refused.contains("uid 4000001 has 4 loads"), "{refused}");
        assert_eq!(super::refused(), busy + 1);
        let others: Vec<Ticket> = (0..IN_ALL - PER_USER)
            .map(|i| Ticket::take(4_000_100 + i as u32).unwrap())
            .collect();
        let refused = Ticket::take(4_000_002).unwrap_err();
        assert!(refused.contains("16 loads"), "{refused}");
        drop(first);
        let again = Ticket::take(4_000_001);
        assert!(again.is_ok());
        drop((again, others));
        assert_eq!(IN_FLIGHT.lock().unwrap().0, 0);
    }
}
