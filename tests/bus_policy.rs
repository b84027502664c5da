//! The shipped bus policy (packaging/dbus/ch.phoeniqs.Agent1.conf) on a real `dbus-daemon` whose
//! default policy is the system bus's (Debian's /usr/share/dbus-1/system.conf: method calls
//! denied, signals and replies allowed, names not ownable), with two listeners for the service's
//! `HealthChanged` (issue 37): root, whom the policy lets hear it, and `nobody`, whom it does not.
//! A broadcast signal has no destination, so only a receive rule can keep it from a user.
//!
//! The listener is this test binary run again (`listener_process`) under the other user's uid:
//! std's `CommandExt::uid` drops root before exec.

mod common;

use common::*;
use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::Duration;

const LISTENER_ENV: &str = "PHQ_BUS_POLICY_LISTENER";

/// The system bus's default policy (as Debian's dbus ships it, system.conf), with the agent's
/// policy file included, on a socket every user may connect to.
fn system_like_bus(dir: &std::path::Path) -> (std::process::Child, String) {
    let socket = dir.join("system_bus_socket");
    let config = dir.join("system.conf");
    let policy = repo().join("packaging/dbus/ch.phoeniqs.Agent1.conf");
    std::fs::write(
        &config,
        format!(
            r#"<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN" "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>system</type>
  <listen>unix:path={}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow user="*"/>
    <deny own="*"/>
    <deny send_type="method_call"/>
    <allow send_type="signal"/>
    <allow send_requested_reply="true" send_type="method_return"/>
    <allow send_requested_reply="true" send_type="error"/>
    <allow receive_type="method_call"/>
    <allow receive_type="method_return"/>
    <allow receive_type="error"/>
    <allow receive_type="signal"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus.Introspectable"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus.Properties"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus.Peer"/>
  </policy>
  <include>{}</include>
</busconfig>
"#,
            socket.display(),
            policy.display()
        ),
    )
    .unwrap();
    let mut daemon = Command::new("dbus-daemon")
        .arg(format!("--config-file={}", config.display()))
        .args(["--nofork", "--print-address=1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(daemon.stdout.take().unwrap()).read_line(&mut line).unwrap();
    (daemon, line.trim().to_string())
}

/// Run as a listener (LISTENER_ENV names the bus): subscribes to HealthChanged, says `ready`,
/// then prints each one it hears for two seconds. Without the variable this test does nothing.
#[test]
fn listener_process() {
    let Ok(address) = std::env::var(LISTENER_ENV) else { return };
    let conn = zbus::blocking::connection::Builder::address(address.as_str()).unwrap().build().unwrap();
    let rule = zbus::MatchRule::builder()
        .msg_type(zbus::message::Type::Signal)
        .interface("ch.phoeniqs.Agent1")
        .unwrap()
        .member("HealthChanged")
        .unwrap()
        .build();
    let signals = zbus::blocking::MessageIterator::for_match_rule(rule, &conn, Some(16)).unwrap();
    println!("ready");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for m in signals.flatten() {
            if let Ok((old, new)) = m.body().deserialize::<(String, String)>() {
                let _ = tx.send(format!("{old}->{new}"));
            }
        }
    });
    while let Ok(heard) = rx.recv_timeout(Duration::from_secs(2)) {
        println!("heard {heard}");
    }
}

/// Starts a listener as `uid`/`gid` on `address`; returns it once it has subscribed.
#[allow(clippy::zombie_processes)] // returned to the caller, which waits for it in `heard`
fn listener(address: &str, uid: u32, gid: u32) -> (std::process::Child, BufReader<std::process::ChildStdout>) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "listener_process", "--nocapture", "--test-threads=1"])
        .env(LISTENER_ENV, address)
        .uid(uid)
        .gid(gid)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "the listener as uid {uid} did not subscribe");
        // libtest writes "test listener_process ... " first, on the same line.
        if line.trim_end().ends_with("ready") {
            return (child, out);
        }
    }
}

fn heard(mut child: std::process::Child, out: BufReader<std::process::ChildStdout>) -> Vec<String> {
    let lines =
        out.lines().map_while(Result::ok).filter_map(|l| l.strip_prefix("heard ").map(str::to_string)).collect();
    let _ = child.wait();
    lines
}

#[test]
fn health_changed_reaches_root_and_not_other_users() {
    if !needs(&[("dbus-daemon", "dbus-daemon")]) {
        return;
    }
    // SAFETY: getuid cannot fail.
    if unsafe { libc::getuid() } != 0 {
        skip("needs root: listeners run as root and as nobody");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let (mut daemon, address) = system_like_bus(dir.path());
    // The service: root may own the name (the policy's root rule; the agent's user in production).
    let service = zbus::blocking::connection::Builder::address(address.as_str())
        .unwrap()
        .name("ch.phoeniqs.Agent1")
        .unwrap()
        .build()
        .expect("root owns ch.phoeniqs.Agent1 under the shipped policy");
    let root = listener(&address, 0, 0);
    let nobody = listener(&address, 65534, 65534);
    for (old, new) in [("healthy", "unhealthy"), ("unhealthy", "healthy")] {
        service
            .emit_signal(None::<()>, "/ch/phoeniqs/Agent1", "ch.phoeniqs.Agent1", "HealthChanged", &(old, new))
            .unwrap();
    }
    let root_heard = heard(root.0, root.1);
    let nobody_heard = heard(nobody.0, nobody.1);
    let _ = daemon.kill();
    let _ = daemon.wait();
    assert_eq!(root_heard, ["healthy->unhealthy", "unhealthy->healthy"], "root hears the service");
    assert_eq!(nobody_heard, Vec::<String>::new(), "another user heard HealthChanged");
}
