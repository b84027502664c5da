//! `collect::deadline::call` keeps one worker parked between calls and hands it the next one,
//! but never hands a worker that was abandoned inside a call another until that call returns.
//! (Its own test binary: the parked worker is the process's, and no other test may take it.)

use phq_agent::collect::deadline::{call, Outcome, Tracker};
use std::sync::mpsc;
use std::thread::ThreadId;
use std::time::Duration;

fn here(_: &Tracker) -> ThreadId {
    std::thread::current().id()
}

fn done<T>(o: Outcome<T>) -> T {
    match o {
        Outcome::Done(v) => v,
        Outcome::Late(_) => panic!("late"),
        Outcome::NotStarted(why) => panic!("{why}"),
    }
}

#[test]
fn a_worker_that_returned_is_reused_and_one_abandoned_is_not() {
    let long = Duration::from_secs(10);
    let first = done(call(long, Tracker::new("first"), None, here));
    assert_ne!(first, std::thread::current().id(), "a call runs on a worker, not the caller");
    for _ in 0..20 {
        assert_eq!(done(call(long, Tracker::new("again"), None, here)), first, "the parked worker is reused");
    }
    // The parked worker blocks past its deadline: the next call gets a new worker at once.
    let (release, blocked) = mpsc::channel::<()>();
    let (tell, told) = mpsc::channel::<ThreadId>();
    let late = call(Duration::from_millis(100), Tracker::new("blocks"), None, move |t| {
        let _ = tell.send(here(t));
        let _ = blocked.recv();
    });
    assert!(matches!(late, Outcome::Late(_)));
    assert_eq!(told.recv().unwrap(), first, "the blocking call took the parked worker");
    let second = done(call(long, Tracker::new("while blocked"), None, here));
    assert_ne!(second, first, "an abandoned worker is handed nothing more while its call runs");
    assert_eq!(done(call(long, Tracker::new("next"), None, here)), second, "the new worker parks in turn");
    // Released, the first worker finds the place taken and ends; the second stays parked.
    release.send(()).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(done(call(long, Tracker::new("after"), None, here)), second);
    // A call that panics ends its worker, and says so; the next call starts another.
    assert!(
        matches!(call(long, Tracker::new("panics"), None, |_| -> u8 { panic!("on purpose") }), Outcome::NotStarted(w) if w.contains("panicked"))
    );
    let third = done(call(long, Tracker::new("after the panic"), None, here));
    assert!(third != second && third != first);
}
