//! systemd unit states over D-Bus (zbus): `nvidia-persistenced` and `nvidia-fabricmanager`.
//!
//! `LoadUnit` (not `GetUnit`) so that a unit systemd has not loaded, or that does not exist, is
//! still answered: its `LoadState` then says `not-found`. The system bus is the one in
//! `DBUS_SYSTEM_BUS_ADDRESS` when set (tests start their own `dbus-daemon`), else the standard
//! socket.

use crate::snapshot::{Fact, UnitState};
use std::time::Duration;
use zbus::blocking::{Connection, Proxy};
use zbus::zvariant::OwnedObjectPath;

/// The units the checks look at.
pub const UNITS: &[&str] = &["nvidia-persistenced.service", "nvidia-fabricmanager.service"];

const SYSTEMD: &str = "org.freedesktop.systemd1";
const MANAGER_PATH: &str = "/org/freedesktop/systemd1";
const MANAGER: &str = "org.freedesktop.systemd1.Manager";
const UNIT: &str = "org.freedesktop.systemd1.Unit";

/// Whether to ask the bus: on the live machine, or when a bus was named explicitly (a test's
/// private `dbus-daemon`, or a support engineer pointing at one).
pub fn should_read(live: bool) -> bool {
    live || std::env::var_os("DBUS_SYSTEM_BUS_ADDRESS").is_some()
}

/// A bus that accepts but never answers must not hang the agent: the whole exchange gets this
/// long, then the units are reported as unreadable.
pub const TIMEOUT: Duration = Duration::from_secs(3);

/// Asks systemd, giving up after `TIMEOUT`. The exchange runs in a thread of its own because the
/// D-Bus handshake itself has no timeout; a thread left waiting on a dead bus ends with the
/// process.
pub fn read() -> Fact<Vec<UnitState>> {
    match within(TIMEOUT, read_blocking) {
        Ok(f) => f,
        Err(why) => Fact::Error(format!("systemd: {why}")),
    }
}

/// Runs `f` in a thread of its own and waits at most `limit` for it: a D-Bus handshake has no
/// timeout of its own, so a wedged bus must not hang the caller. A thread left waiting ends with
/// the process.
pub fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> Result<T, String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("dbus-call".into())
        .spawn(move || {
            let _ = tx.send(f());
        })
        .map_err(|e| format!("cannot start the D-Bus thread: {e}"))?;
    rx.recv_timeout(limit).map_err(|_| format!("the system bus did not answer within {} s", limit.as_secs()))
}

/// The bus connection kept between readings: the service asks every 30 s, and a new
/// connection each time is a handshake, an authentication and a new unique name on the bus.
/// Forgotten on any error, so the next reading connects again (the bus restarted).
static CONNECTION: std::sync::Mutex<Option<Connection>> = std::sync::Mutex::new(None);

fn held() -> std::sync::MutexGuard<'static, Option<Connection>> {
    CONNECTION.lock().unwrap_or_else(|p| p.into_inner())
}

fn connection() -> zbus::Result<Connection> {
    if let Some(c) = held().as_ref() {
        return Ok(c.clone());
    }
    let c = zbus::blocking::connection::Builder::system().and_then(|b| b.method_timeout(TIMEOUT).build())?;
    *held() = Some(c.clone());
    Ok(c)
}

fn read_blocking() -> Fact<Vec<UnitState>> {
    let conn = match connection() {
        Ok(c) => c,
        Err(e) => return Fact::Error(format!("no system D-Bus to ask systemd: {e}")),
    };
    let asked = (|| {
        let manager =
            Proxy::new(&conn, SYSTEMD, MANAGER_PATH, MANAGER).map_err(|e| format!("systemd manager proxy: {e}"))?;
        UNITS
            .iter()
            .map(|name| unit_state(&conn, &manager, name).map_err(|e| format!("asking systemd about {name}: {e}")))
            .collect::<Result<Vec<_>, String>>()
    })();
    match asked {
        Ok(units) => Fact::Value(units),
        Err(e) => {
            *held() = None;
            Fact::Error(e)
        }
    }
}

fn unit_state(conn: &Connection, manager: &Proxy<'_>, name: &str) -> zbus::Result<UnitState> {
    let path: OwnedObjectPath = manager.call("LoadUnit", &(name,))?;
    let unit = Proxy::new(conn, SYSTEMD, path, UNIT)?;
    let prop = |p: &str| -> zbus::Result<String> { unit.get_property::<String>(p) };
    Ok(UnitState {
        name: name.to_string(),
        load_state: prop("LoadState")?,
        active_state: prop("ActiveState")?,
        sub_state: prop("SubState").unwrap_or_default(),
        unit_file_state: prop("UnitFileState").unwrap_or_default(),
    })
}
