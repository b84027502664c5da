//! Calls that may never return, each on a worker thread the caller can stop waiting for.
//!
//! On a machine whose GPU has fallen off the bus or whose GSP stopped answering (Xid 79, 119),
//! NVML calls do not fail: they block, for minutes or for good. A thread blocked inside a C
//! library cannot be cancelled, so the rules are:
//!
//! 1. A call runs on a worker thread (`nvml-call`) that nothing else is using: the one worker a
//!    call that returned left parked, else a fresh one; the caller waits for it at most its
//!    deadline. A worker abandoned inside a call is never handed another until it returns.
//!    (Reusing the parked worker spares the service a dozen thread starts a snapshot: it is at
//!    rest most of its life.) — `call`, `Worker`.
//! 2. A call still running at its deadline is abandoned, not killed: the caller gets a `Late`,
//!    which says what the call was doing when it was abandoned (the `Tracker`), since when, and
//!    whether it has since returned. — `Late`.
//! 3. Whoever holds a `Late` starts no other call on the same thing (NVML as a whole, one GPU)
//!    until it has returned, so a call that never returns costs one thread for good, not one
//!    per snapshot. — `collect::nvml::Session`.
//! 4. When an abandoned call does return, the `answered` hook runs, on the worker itself, so
//!    the service can take a snapshot at once instead of at its next tick.
//! 5. How many abandoned calls have not returned is counted here, for /metrics and for the
//!    tests that hold rule 3. — `abandoned_running`.
//!
//! 6. A child process started for work that may not end dies with the thread that started it
//!    (`PR_SET_PDEATHSIG`), so a parent killed at its own deadline leaves no orphan behind.
//!    — `dies_with_parent`.
//!
//! Nothing here knows NVML: the module must not grow knowledge of what it runs.

use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

/// Rule 6: `cmd`'s process gets SIGKILL when the thread that spawns it exits (prctl(2),
/// `PR_SET_PDEATHSIG`), and refuses to start if that parent is already gone.
pub fn dies_with_parent(cmd: &mut std::process::Command) {
    use std::os::unix::process::CommandExt;
    // The parent's pid, taken before the fork: a parent gone before prctl took effect is seen
    // as a new parent pid.
    // SAFETY: getpid has no preconditions.
    let parent = unsafe { libc::getpid() };
    // SAFETY: between fork and exec only prctl, getppid and errno reads run, all
    // async-signal-safe; nothing allocates (a parent gone already is ESRCH, for no one reads it).
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() != parent {
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
}

/// Abandoned calls whose thread has not returned (rule 5).
static ABANDONED_RUNNING: AtomicUsize = AtomicUsize::new(0);

/// How many calls passed their deadline and are still blocked, in this process.
pub fn abandoned_running() -> usize {
    ABANDONED_RUNNING.load(Ordering::SeqCst)
}

const RUNNING: u8 = 0;
const ABANDONED: u8 = 1;
const FINISHED: u8 = 2;

/// What a worker is doing now: the function it is in (set before each call it makes), and the
/// GPU's PCI address once it has read it. A late call is named from this (rule 2).
#[derive(Debug, Default)]
pub struct Tracker {
    at: Mutex<&'static str>,
    address: Mutex<Option<String>>,
}

impl Tracker {
    pub fn new(first: &'static str) -> Arc<Tracker> {
        Arc::new(Tracker { at: Mutex::new(first), address: Mutex::new(None) })
    }

    /// Notes that the worker is about to call `function`.
    pub fn at(&self, function: &'static str) {
        *self.at.lock().unwrap_or_else(|p| p.into_inner()) = function;
    }

    pub fn current(&self) -> &'static str {
        *self.at.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn set_address(&self, address: &str) {
        *self.address.lock().unwrap_or_else(|p| p.into_inner()) = Some(address.to_string());
    }

    pub fn address(&self) -> Option<String> {
        self.address.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// The hook rule 4 runs when an abandoned call returns.
pub type Answered = Arc<dyn Fn() + Send + Sync>;

/// A call past its deadline (rule 2). Dropping it does not stop the thread.
pub struct Late<T> {
    state: Arc<AtomicU8>,
    /// `None` once the answer is no longer wanted (`forget`).
    rx: Option<mpsc::Receiver<T>>,
    pub tracker: Arc<Tracker>,
    pub since: Instant,
    pub since_wall: SystemTime,
    pub deadline: Duration,
}

impl<T> std::fmt::Debug for Late<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Late").field("at", &self.tracker.current()).field("since", &self.since).finish()
    }
}

impl<T> Late<T> {
    /// What the call returned, once it has: `Some(Ok)`. `Some(Err)`: it ended without an
    /// answer (it panicked). `None`: still blocked.
    pub fn poll(&self) -> Option<Result<T, ()>> {
        let Some(rx) = &self.rx else { return self.finished().then_some(Err(())) };
        match rx.try_recv() {
            Ok(v) => Some(Ok(v)),
            Err(mpsc::TryRecvError::Empty) => None,
            Err(mpsc::TryRecvError::Disconnected) => Some(Err(())),
        }
    }

    /// Whether the worker has returned (without taking its answer).
    pub fn finished(&self) -> bool {
        self.state.load(Ordering::SeqCst) == FINISHED
    }

    /// The same call, its answer no longer wanted: only whether it has returned is kept.
    pub fn forget(self) -> Late<()> {
        let Late { state, tracker, since, since_wall, deadline, .. } = self;
        Late { state, rx: None, tracker, since, since_wall, deadline }
    }

    pub fn blocked_for(&self) -> Duration {
        self.since.elapsed()
    }
}

/// How a call ended for its caller.
pub enum Outcome<T> {
    Done(T),
    Late(Late<T>),
    /// No thread could be started (the process is out of them); the call was not made.
    NotStarted(String),
}

/// A job for a worker thread: the call, which gives back how to deliver its answer. The worker
/// parks before it delivers, so a caller that has the answer finds it parked.
type Job = Box<dyn FnOnce() -> Deliver + Send>;
type Deliver = Box<dyn FnOnce() + Send>;

/// The one idle worker, parked waiting for a job (rule 1): its sender. A worker that finishes a
/// job parks here if the place is free, and ends otherwise.
static IDLE: Mutex<Option<mpsc::Sender<Job>>> = Mutex::new(None);

/// Hands `job` to the parked worker, or to a new one when none is parked (or the parked one has
/// gone); the error when no thread can be started.
fn run_on_worker(job: Job) -> std::io::Result<()> {
    let parked = IDLE.lock().unwrap_or_else(|p| p.into_inner()).take();
    let job = match parked {
        Some(worker) => match worker.send(job) {
            Ok(()) => return Ok(()),
            Err(mpsc::SendError(job)) => job,
        },
        None => job,
    };
    let (tx, rx) = mpsc::channel::<Job>();
    tx.send(job).map_err(|_| std::io::Error::other("the new worker's channel is closed"))?;
    std::thread::Builder::new().name("nvml-call".into()).spawn(move || {
        // A job that panics ends the thread here, with its answer's sender dropped: the caller
        // is told the worker panicked, and this worker parks no more.
        while let Ok(job) = rx.recv() {
            let deliver = job();
            let parked = {
                let mut idle = IDLE.lock().unwrap_or_else(|p| p.into_inner());
                let free = idle.is_none();
                if free {
                    *idle = Some(tx.clone());
                }
                free
            };
            deliver();
            if !parked {
                return;
            }
        }
    })?;
    Ok(())
}

/// Runs `f` on a worker thread and waits for it at most `deadline` (rules 1, 2 and 4).
/// `since` is when the call started, for the `Late`: the caller's clock, so a late call's age
/// counts from when it was made, not from when it was given up.
pub fn call<T: Send + 'static>(
    deadline: Duration,
    tracker: Arc<Tracker>,
    answered: Option<Answered>,
    f: impl FnOnce(&Tracker) -> T + Send + 'static,
) -> Outcome<T> {
    let (tx, rx) = mpsc::sync_channel(1);
    let state = Arc::new(AtomicU8::new(RUNNING));
    let (worker_state, worker_tracker) = (state.clone(), tracker.clone());
    let (since, since_wall) = (Instant::now(), SystemTime::now());
    let spawned = run_on_worker(Box::new(move || {
        let v = f(&worker_tracker);
        Box::new(move || {
            let _ = tx.send(v);
            if worker_state.swap(FINISHED, Ordering::SeqCst) == ABANDONED {
                ABANDONED_RUNNING.fetch_sub(1, Ordering::SeqCst);
                if let Some(hook) = answered {
                    hook();
                }
            }
        })
    }));
    if let Err(e) = spawned {
        return Outcome::NotStarted(format!("cannot start a worker thread: {e}"));
    }
    match rx.recv_timeout(deadline) {
        Ok(v) => Outcome::Done(v),
        Err(mpsc::RecvTimeoutError::Disconnected) => Outcome::NotStarted("the worker thread panicked".into()),
        Err(mpsc::RecvTimeoutError::Timeout) => {
            // The worker may have finished between the timeout and now: then its answer counts.
            if state.compare_exchange(RUNNING, ABANDONED, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
                ABANDONED_RUNNING.fetch_add(1, Ordering::SeqCst);
                return Outcome::Late(Late { state, rx: Some(rx), tracker, since, since_wall, deadline });
            }
            match rx.recv() {
                Ok(v) => Outcome::Done(v),
                Err(_) => Outcome::NotStarted("the worker thread panicked".into()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_within_its_deadline_is_done() {
        let t = Tracker::new("f");
        assert!(matches!(call(Duration::from_secs(10), t, None, |_| 7), Outcome::Done(7)));
    }

    #[test]
    fn a_call_past_its_deadline_is_late_names_where_it_is_and_answers_the_hook_when_it_returns() {
        let (release_tx, release_rx) = mpsc::channel::<()>();
        let (hook_tx, hook_rx) = mpsc::channel::<()>();
        let hook_tx = Mutex::new(hook_tx);
        let hook: Answered = Arc::new(move || {
            let _ = hook_tx.lock().unwrap().send(());
        });
        let out = call(Duration::from_millis(50), Tracker::new("start"), Some(hook), move |t| {
            t.at("nvmlDeviceGetMemoryInfo_v2");
            let _ = release_rx.recv(); // blocks until the test lets it go
            5
        });
        let Outcome::Late(late) = out else { panic!("the call blocks past its deadline") };
        assert_eq!(late.tracker.current(), "nvmlDeviceGetMemoryInfo_v2");
        assert!(late.poll().is_none() && !late.finished());
        release_tx.send(()).unwrap();
        hook_rx.recv().unwrap();
        assert!(late.finished());
        assert_eq!(late.poll(), Some(Ok(5)));
    }
}
