//! The lock, and root's files in the journal's directory never opened through a link.

use super::*;
use crate::install::apply::apply;
use crate::install::journal::{state_path, JOURNAL_DIR};
use crate::install::runner::SystemRunner;
use crate::install::test_machine::*;
use crate::install::RebootPolicy;
use std::time::Duration;

/// Root's files never follow a link the service's user (or anyone) planted: the journal's
/// directory must be root's and closed to others, and the lock and the log are opened with
/// O_NOFOLLOW; each planted link leaves its target untouched.
#[test]
fn planted_links_in_the_journal_directory_leave_their_targets_untouched() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let victim = dir.path().join("victim");
    std::fs::write(&victim, "precious\n").unwrap();
    let journal = dir.path().join("journal");
    std::fs::create_dir(&journal).unwrap();
    for name in ["lock", "log"] {
        std::os::unix::fs::symlink(&victim, journal.join(name)).unwrap();
    }
    let e = lock(&journal).err().unwrap().to_string();
    assert!(e.contains("is a symbolic link"), "{e}");
    let e = lock_wait(&journal).err().unwrap().to_string();
    assert!(e.contains("is a symbolic link"), "{e}");
    let runner = SystemRunner::new(&journal);
    assert!(runner.log.is_none());
    // The journal itself: a link at its name is replaced, never written through.
    std::os::unix::fs::symlink(&victim, state_path(&journal)).unwrap();
    let (_, p, mut m) = fresh_install(None);
    with_options(dir.path(), RebootPolicy::Never, Some("b"), 1, Duration::ZERO, |o| apply(&p, &mut m, o).unwrap());
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious\n");
    assert!(!std::fs::symlink_metadata(state_path(&journal)).unwrap().file_type().is_symlink());

    // A journal directory that is a link, or that others can write, is refused.
    let linked = dir.path().join("linked");
    std::os::unix::fs::symlink(dir.path().join("elsewhere"), &linked).unwrap();
    std::fs::create_dir(dir.path().join("elsewhere")).unwrap();
    assert!(lock(&linked).err().unwrap().to_string().contains("not a directory of uid"));
    std::fs::set_permissions(&journal, std::fs::Permissions::from_mode(0o777)).unwrap();
    assert!(lock(&journal).err().unwrap().to_string().contains("open to others"));
    assert_eq!(std::fs::read_dir(dir.path().join("elsewhere")).unwrap().count(), 0);
    // The journal's default home is root's own, outside the service's state directory.
    assert!(!JOURNAL_DIR.starts_with(&format!("{}/", crate::config::AgentConfig::default().state_dir.display())));
}

#[test]
fn the_lock_refuses_a_second_installer() {
    let dir = tempfile::tempdir().unwrap();
    let held = lock(dir.path()).unwrap();
    let e = lock(dir.path()).err().unwrap().to_string();
    assert!(e.contains("another phq-agent install is running") && e.contains(&std::process::id().to_string()), "{e}");
    drop(held);
    assert!(lock(dir.path()).is_ok());
}
