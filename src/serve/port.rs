//! The service's TCP port is the service's (issue 37). Port 9440 is above 1024, so any user may
//! bind it; whoever does first answers `/healthz` for KubeVirt and collects every token the
//! poller and Prometheus send. Two things keep it ours:
//!
//! 1. Under systemd the port is bound by PID 1 itself (`phq-agent.socket`), at `sockets.target`,
//!    before `basic.target` and so before any user session or user service can run a program;
//!    the service takes that socket (`sd_listen_fds(3)`) and never binds the port itself.
//! 2. Run by hand, the service binds the port; when someone holds it already, it stops with an
//!    error that says who (the listening socket's owner from /proc/net/tcp, and the process
//!    when /proc lets us see it) and exits with `EXIT_PORT_TAKEN`, which the unit lists in
//!    `RestartPreventExitStatus=`: a squatter is not fixed by restarting in a loop.
//!
//! Nothing here reads anything but /proc and /etc/passwd of the machine it runs on: this is about
//! the live process, not a sysroot.

use std::net::SocketAddr;
use std::os::fd::{FromRawFd, RawFd};
use tokio::net::TcpListener;

/// The exit code of `serve` when its port is held by another process (sysexits' `EX_UNAVAILABLE`).
pub const EXIT_PORT_TAKEN: i32 = 69;

/// Another process listens on the port `serve` was told to use.
#[derive(Debug)]
pub struct PortTaken {
    pub addr: SocketAddr,
    /// Who holds it, as far as this process can see.
    pub holders: Vec<Holder>,
}

impl std::fmt::Display for PortTaken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "port {} (http.listen {}) is held by another process: ", self.addr.port(), self.addr)?;
        if self.holders.is_empty() {
            write!(f, "its owner is not visible in /proc/net")?;
        }
        let said: Vec<String> = self.holders.iter().map(Holder::to_string).collect();
        write!(
            f,
            "{}. Nothing is served and no token is accepted on a port another process holds: stop it, or start \
             the agent through phq-agent.socket, which systemd binds at boot before any user can",
            said.join("; ")
        )
    }
}

impl std::error::Error for PortTaken {}

/// One listening socket on the port, and its process when visible.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    pub local: String,
    pub uid: u32,
    pub user: Option<String>,
    pub inode: u64,
    pub process: Option<(u32, String)>,
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let user = self.user.as_deref().map(|u| format!(" ({u})")).unwrap_or_default();
        write!(f, "a socket on {} owned by uid {}{user}", self.local, self.uid)?;
        match &self.process {
            Some((pid, comm)) => write!(f, ", process {pid} ({comm})"),
            None => write!(f, ", process not visible to this user"),
        }
    }
}

/// The endpoint's listener and a line saying where it came from: the socket systemd passed,
/// else `addr` bound here with `bind`.
pub fn listener(
    addr: SocketAddr,
    bind: impl FnOnce(SocketAddr) -> std::io::Result<TcpListener>,
) -> anyhow::Result<(TcpListener, String)> {
    if let Some(fd) = passed_socket()? {
        let l = adopt(fd)?;
        let local = l.local_addr()?;
        let mut said = format!("the socket systemd passed ({local}, phq-agent.socket)");
        if local.port() != addr.port() {
            said.push_str(&format!("; http.listen ({addr}) names another port and is not used"));
        }
        return Ok((l, said));
    }
    match bind(addr) {
        Ok(l) => Ok((l, addr.to_string())),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
            Err(anyhow::Error::new(PortTaken { addr, holders: holders(addr.port()) }))
        }
        Err(e) => Err(anyhow::Error::new(e).context(format!("cannot listen on {addr} (http.listen)"))),
    }
}

/// The first socket systemd passed this process (`LISTEN_PID`/`LISTEN_FDS`), if any.
fn passed_socket() -> anyhow::Result<Option<RawFd>> {
    let mut fds = sd_notify::listen_fds().map_err(|e| anyhow::anyhow!("LISTEN_FDS from systemd: {e}"))?;
    Ok(fds.next())
}

/// Takes the passed descriptor as a listening TCP socket, refusing anything else (a datagram
/// socket, a UNIX socket, a socket not yet listening).
fn adopt(fd: RawFd) -> anyhow::Result<TcpListener> {
    let int_opt = |level, name| -> std::io::Result<libc::c_int> {
        let mut v: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: `v` and `len` are valid for writes of a c_int; getsockopt fails cleanly (ENOTSOCK,
        // EBADF) on a descriptor that is not a socket.
        let r = unsafe { libc::getsockopt(fd, level, name, (&mut v as *mut libc::c_int).cast(), &mut len) };
        if r == 0 {
            Ok(v)
        } else {
            Err(std::io::Error::last_os_error())
        }
    };
    let what = |e: std::io::Error| anyhow::anyhow!("the descriptor systemd passed (fd {fd}) is not a socket: {e}");
    let domain = int_opt(libc::SOL_SOCKET, libc::SO_DOMAIN).map_err(what)?;
    let kind = int_opt(libc::SOL_SOCKET, libc::SO_TYPE).map_err(what)?;
    let listening = int_opt(libc::SOL_SOCKET, libc::SO_ACCEPTCONN).map_err(what)?;
    if !matches!(domain, libc::AF_INET | libc::AF_INET6) || kind != libc::SOCK_STREAM || listening == 0 {
        anyhow::bail!(
            "the socket systemd passed (fd {fd}) is not a listening TCP socket (domain {domain}, type {kind}): \
             phq-agent.socket must say ListenStream="
        );
    }
    // SAFETY: systemd hands this descriptor to this process alone (LISTEN_PID is ours) and it is
    // taken exactly once, here; it is a listening stream socket (checked above).
    let std = unsafe { std::net::TcpListener::from_raw_fd(fd) };
    std.set_nonblocking(true)?;
    Ok(TcpListener::from_std(std)?)
}

/// Who listens on `port`, from /proc/net/tcp and tcp6, with the process where /proc shows it.
pub fn holders(port: u16) -> Vec<Holder> {
    let mut out = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        if let Ok(text) = std::fs::read_to_string(table) {
            out.extend(listening_on(&text, port));
        }
    }
    let passwd = std::fs::read_to_string("/etc/passwd").unwrap_or_default();
    for h in &mut out {
        h.user = user_name(&passwd, h.uid);
        h.process = process_with_socket(h.inode);
    }
    out
}

/// The listening sockets on `port` in a /proc/net/tcp table (`proc(5)`: `sl local_address
/// rem_address st … uid timeout inode`; addresses as hex `ADDR:PORT`, state `0A` is LISTEN).
pub fn listening_on(table: &str, port: u16) -> Vec<Holder> {
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let (local, state, uid, inode) = (f.get(1)?, f.get(3)?, f.get(7)?, f.get(9)?);
            let (_, hex_port) = local.rsplit_once(':')?;
            (*state == "0A" && u16::from_str_radix(hex_port, 16).ok()? == port).then_some(())?;
            Some(Holder {
                local: local.to_string(),
                uid: uid.parse().ok()?,
                user: None,
                inode: inode.parse().ok()?,
                process: None,
            })
        })
        .collect()
}

/// A user's name from /etc/passwd's text.
pub fn user_name(passwd: &str, uid: u32) -> Option<String> {
    passwd.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        (f.len() > 2 && f[2].parse() == Ok(uid)).then(|| f[0].to_string())
    })
}

/// The process holding socket `inode`, if this user can see its descriptors.
fn process_with_socket(inode: u64) -> Option<(u32, String)> {
    let want = format!("socket:[{inode}]");
    for proc_dir in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = proc_dir.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        let Ok(fds) = std::fs::read_dir(proc_dir.path().join("fd")) else { continue };
        if fds.flatten().any(|fd| std::fs::read_link(fd.path()).is_ok_and(|t| t.as_os_str() == want.as_str())) {
            let comm = std::fs::read_to_string(proc_dir.path().join("comm")).unwrap_or_default();
            return Some((pid, comm.trim().to_string()));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A /proc/net/tcp table as the kernel prints it: a listener on 9440 (0x24E0) owned by uid
    /// 65534, a connection from that port, and a listener on another port.
    const TABLE: &str = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:24E0 00000000:0000 0A 00000000:00000000 00:00000000 00000000 65534        0 123456 1 0000000000000000 100 0 0 10 0
   1: 0100007F:24E0 0100007F:9C40 01 00000000:00000000 00:00000000 00000000     0        0 123457 1 0000000000000000 20 4 30 10 -1
   2: 00000000:0016 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2222 1 0000000000000000 100 0 0 10 0
";

    #[test]
    fn the_listener_on_the_port_and_its_owner() {
        let got = listening_on(TABLE, 9440);
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!((got[0].uid, got[0].inode, got[0].local.as_str()), (65534, 123456, "0100007F:24E0"));
        assert!(listening_on(TABLE, 9441).is_empty());
        assert!(listening_on("garbage\n\n x y z\n", 9440).is_empty());
        let passwd = "root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n";
        assert_eq!(user_name(passwd, 65534).as_deref(), Some("nobody"));
        assert_eq!(user_name(passwd, 7), None);
    }

    /// A port this process holds: the error names the port, the owner's uid and this process.
    #[test]
    fn a_held_port_names_who_holds_it() {
        let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = held.local_addr().unwrap();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let _guard = rt.enter();
        let e = listener(addr, crate::serve::http::listen).unwrap_err();
        let taken = e.downcast_ref::<PortTaken>().expect("a PortTaken");
        let me = std::process::id();
        assert!(taken.holders.iter().any(|h| h.process.as_ref().is_some_and(|(pid, _)| *pid == me)), "{taken}");
        let text = taken.to_string();
        // SAFETY: getuid cannot fail.
        let uid = unsafe { libc::getuid() };
        assert!(text.contains(&format!("port {}", addr.port())) && text.contains(&format!("uid {uid}")), "{text}");
    }
}
