//! The journal's state machine, as zincati tests its update agent's: one install through every
//! status by the transitions the installer makes, and each move no status allows refused.

use super::*;

fn warn(id: &str) -> Finding {
    Finding::warn(id, "test")
}

/// Through every status the way an install goes: steps, a reboot asked for, the boot after it,
/// a reboot that must wait, a failure, and the rerun that finishes.
#[test]
fn an_install_goes_through_every_status() {
    let mut st = State::new("plan");
    assert_eq!(st.status, Status::Running);
    st.begin("plan", vec![warn("install.plan")], Some("boot-1")).unwrap();
    st.start_step(&[StepId::Toolkit]).unwrap();
    st.finish_step(StepId::Driver, "h1".into(), 1.5, true, Some("boot-1")).unwrap();
    assert!(st.has_step(StepId::Driver, "h1") && !st.has_step(StepId::Driver, "h2"));
    assert_eq!(st.reboot_pending(), Some("step driver changed the kernel modules or the initramfs"));
    assert_eq!(st.reboot_pending_since.as_deref(), Some("boot-1"));
    // A second reason does not replace the first.
    st.need_reboot(Some("boot-1"), "another".into()).unwrap();
    assert_eq!(st.reboot_pending(), Some("step driver changed the kernel modules or the initramfs"));
    st.start_reboot().unwrap();
    assert_eq!(st.status, Status::Rebooting);

    // The same boot again (the reboot has not happened): still pending.
    st.begin("plan", vec![], Some("boot-1")).unwrap();
    assert_eq!((st.status, st.reboots), (Status::Running, 0));
    assert!(st.reboot_pending().is_some());
    // The next boot: counted once, forgotten.
    st.begin("plan", vec![], Some("boot-2")).unwrap();
    assert_eq!((st.reboots, st.reboot_pending()), (1, None));
    st.begin("plan", vec![], Some("boot-3")).unwrap();
    assert_eq!(st.reboots, 1);

    st.finish_step(StepId::Nouveau, "h2".into(), 0.1, true, None).unwrap();
    assert_eq!(st.reboot_pending_since.as_deref(), Some("unknown"));
    st.await_reboot(None, warn("install.reboot-required")).unwrap();
    assert_eq!((st.status, &st.error), (Status::RebootRequired, &None));
    // An unknown boot proves nothing: the reboot stays pending.
    st.begin("plan", vec![], Some("boot-4")).unwrap();
    assert!(st.reboot_pending().is_some());
    st.start_reboot().unwrap();
    st.await_reboot(Some("could not reboot".into()), warn("install.reboot-required")).unwrap();
    assert_eq!(st.error.as_deref(), Some("could not reboot"));

    st.begin("plan", vec![], None).unwrap();
    assert_eq!(st.error, None);
    st.skip_step(warn("install.nccl")).unwrap();
    st.fail("step toolkit: no".into(), warn("install.step-failed")).unwrap();
    assert_eq!(st.status, Status::Failed);
    let ids: Vec<&str> = st.findings.iter().map(|f| f.id.as_str()).collect();
    assert_eq!(ids, ["install.nccl", "install.step-failed"]);

    st.begin("plan", vec![], None).unwrap();
    // The driver runs again: the steps after it are judged afresh.
    st.start_step(&[StepId::Nouveau, StepId::Toolkit]).unwrap();
    assert!(st.has_step(StepId::Driver, "h1") && !st.steps.contains_key("nouveau"));
    st.complete(vec![warn("gpu.ecc")]).unwrap();
    assert_eq!(st.status, Status::Done);
    // What is written reads back the same, in the format cloud-init greps.
    let text = String::from_utf8(journal_bytes(&st).unwrap()).unwrap();
    assert!(text.contains("\"status\": \"done\""), "{text}");
    assert_eq!(serde_json::from_str::<State>(&text).unwrap(), st);
}

/// Each end is reached only from a running install; a finished, failed or stopped journal
/// changes nothing until a run begins; and a refused move leaves the journal as it was.
#[test]
fn an_illegal_transition_is_refused() {
    let ended = |status: Status| {
        let mut st = State::new("plan");
        st.status = status;
        st
    };
    for from in [Status::RebootRequired, Status::Rebooting, Status::Failed, Status::Done] {
        let mut st = ended(from);
        let before = st.clone();
        assert_eq!(st.complete(vec![warn("x")]), Err(IllegalTransition { from, to: Status::Done }));
        assert!(st.fail("x".into(), warn("x")).is_err(), "{from}");
        assert!(st.start_reboot().is_err(), "{from}");
        assert!(st.start_step(&[]).is_err(), "{from}");
        assert!(st.finish_step(StepId::Driver, "h".into(), 0.0, true, None).is_err(), "{from}");
        assert!(st.skip_step(warn("x")).is_err(), "{from}");
        assert!(st.need_reboot(None, "x".into()).is_err(), "{from}");
        assert_eq!(st, before, "a refused move changed the journal ({from})");
    }
    // Only a failed reboot leaves the rebooting state for reboot-required.
    assert!(ended(Status::Rebooting).await_reboot(None, warn("x")).is_ok());
    for from in [Status::RebootRequired, Status::Failed, Status::Done] {
        assert!(ended(from).await_reboot(None, warn("x")).is_err(), "{from}");
    }
    let e = ended(Status::Done).complete(vec![]).unwrap_err();
    assert_eq!(e.to_string(), "the install journal cannot go from done to done");
    // Whatever the last run left, a new one may begin.
    for from in [Status::Running, Status::RebootRequired, Status::Rebooting, Status::Failed, Status::Done] {
        assert!(ended(from).begin("plan", vec![], None).is_ok(), "{from}");
    }
}
