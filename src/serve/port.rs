//! The service's ports are the service's (issue 37 for TCP, issue 40's follow-up for vsock). Port
//! 9440 is above 1023, so any user may bind it, on TCP and on vsock alike (Linux
//! net/vmw_vsock/af_vsock.c `__vsock_bind_connectible` asks `CAP_NET_BIND_SERVICE` only below
//! `LAST_RESERVED_PORT`, 1023); whoever does first answers `/healthz` for KubeVirt and collects
//! every token the poller and Prometheus send, or, on vsock, answers the platform in the agent's
//! place (virt-handler does not verify the agent's certificate). Three things keep them ours:
//!
//! 1. Under systemd each port is bound by PID 1 itself (`phq-agent.socket` for TCP,
//!    `phq-agent-vsock.socket` for vsock), at `sockets.target`, before `basic.target` and so
//!    before any user session or user service can run a program; the service takes those sockets
//!    (`sd_listen_fds(3)`) and never binds a port itself.
//! 2. The sockets are told apart by name (`LISTEN_FDNAMES`, each unit's `FileDescriptorName=`):
//!    `http` is the TCP listener's, `vsock` the vsock listener's, and each is checked to be the
//!    kind of socket its name says before it is served. A single socket without a name is the
//!    TCP listener's, as it was before the vsock unit existed.
//! 3. Run by hand, the service binds its ports; when someone holds one already, it stops with an
//!    error that says who (for TCP, the listening socket's owner from /proc/net/tcp and the process
//!    when /proc lets us see it; vsock has no such table) and exits with `EXIT_PORT_TAKEN`, which
//!    the unit lists in `RestartPreventExitStatus=`: a squatter is not fixed by restarting in a loop.
//!
//! Nothing here reads anything but the environment, /proc and /etc/passwd of the machine it runs
//! on: this is about the live process, not a sysroot.

use super::vsock::VsockListener;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Mutex, OnceLock};
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

/// Another process listens on the vsock port `serve` was told to use.
#[derive(Debug)]
pub struct VsockPortTaken {
    pub port: u32,
}

impl std::fmt::Display for VsockPortTaken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "vsock port {} (vsock.port) is held by another process (Linux keeps no table of vsock sockets to say \
             which). The platform's channel is not served from a port another process holds: stop it, or start \
             the agent through phq-agent-vsock.socket, which systemd binds at boot before any user can",
            self.port
        )
    }
}

impl std::error::Error for VsockPortTaken {}

/// Whether `serve` stopped because one of its ports is held by another process (`EXIT_PORT_TAKEN`).
pub fn is_port_taken(e: &anyhow::Error) -> bool {
    e.downcast_ref::<PortTaken>().is_some() || e.downcast_ref::<VsockPortTaken>().is_some()
}

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
    if let Some(fd) = take_passed(Purpose::Http)? {
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

/// The vsock listener and a line saying where it came from: the socket systemd passed
/// (`phq-agent-vsock.socket`), else `port` bound here with `bind`. A bind error other than a held
/// port comes back as the `io::Error` itself, so the caller can tell a machine without vsock
/// (`vsock::means_no_device`) from a port that is wrong.
pub fn vsock_listener(
    passed: Option<OwnedFd>,
    port: u32,
    bind: impl FnOnce(u32) -> std::io::Result<VsockListener>,
) -> anyhow::Result<(VsockListener, String)> {
    if let Some(fd) = passed {
        let l = adopt_vsock(fd)?;
        let mut said = format!("the socket systemd passed (vsock port {}, phq-agent-vsock.socket)", l.port());
        if l.port() != port {
            said.push_str(&format!("; vsock.port ({port}) names another port and is not used"));
        }
        return Ok((l, said));
    }
    match bind(port) {
        Ok(l) => Ok((l, format!("vsock port {port}"))),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => Err(anyhow::Error::new(VsockPortTaken { port })),
        Err(e) => Err(anyhow::Error::new(e)),
    }
}

/// What each socket systemd passes is for: its `FileDescriptorName=` (rule 2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    /// `phq-agent.socket`: the TCP listener.
    Http = 0,
    /// `phq-agent-vsock.socket`: the vsock listener.
    Vsock = 1,
}

impl Purpose {
    /// The name the unit gives its descriptors (`FileDescriptorName=` in packaging/systemd).
    pub fn fd_name(self) -> &'static str {
        match self {
            Purpose::Http => "http",
            Purpose::Vsock => "vsock",
        }
    }

    fn unit(self) -> &'static str {
        match self {
            Purpose::Http => "phq-agent.socket",
            Purpose::Vsock => "phq-agent-vsock.socket",
        }
    }

    /// The purpose a descriptor's name says. systemd names a socket unit's descriptors after the
    /// unit when it sets no `FileDescriptorName=` (systemd.socket(5)), so the unit names count too.
    fn of(name: &str) -> Option<Purpose> {
        [Purpose::Http, Purpose::Vsock].into_iter().find(|p| name == p.fd_name() || name == p.unit())
    }
}

/// The descriptors systemd passed, by purpose.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Passed {
    pub http: Option<RawFd>,
    pub vsock: Option<RawFd>,
}

/// The first descriptor systemd passes (`SD_LISTEN_FDS_START`, sd_listen_fds(3)).
const LISTEN_FDS_START: RawFd = 3;

/// Reads what systemd passed from the values of `LISTEN_PID`, `LISTEN_FDS` and `LISTEN_FDNAMES`,
/// by sd_listen_fds(3)'s rules as libsystemd keeps them (src/libsystemd/sd-daemon/sd-daemon.c):
/// nothing is passed unless `LISTEN_PID` is this process (`me`) and `LISTEN_FDS` is set; a
/// variable that is not a number, or a count below 1, is an error; the descriptors are
/// `LISTEN_FDS` in a row from 3; `LISTEN_FDNAMES` holds one name per descriptor separated by
/// colons, empty names kept, and a different count is an error; without it every name is
/// `unknown`. Then rule 2: each name says a purpose, and one socket without a known name is
/// the TCP listener's.
pub fn passed_from(pid: Option<&str>, fds: Option<&str>, names: Option<&str>, me: u32) -> anyhow::Result<Passed> {
    let (Some(pid), Some(fds)) = (pid, fds) else { return Ok(Passed::default()) };
    let pid: u32 = pid.parse().map_err(|_| anyhow::anyhow!("LISTEN_PID from systemd is not a process id: {pid:?}"))?;
    if pid != me {
        return Ok(Passed::default());
    }
    let n: RawFd = match fds.parse() {
        Ok(n) if n > 0 && n <= RawFd::MAX - LISTEN_FDS_START => n,
        _ => anyhow::bail!("LISTEN_FDS from systemd is not a count of descriptors: {fds:?}"),
    };
    let names: Vec<&str> = match names {
        Some(names) => names.split(':').collect(),
        None => vec!["unknown"; n as usize],
    };
    if names.len() != n as usize {
        anyhow::bail!(
            "systemd passed {n} sockets but LISTEN_FDNAMES names {} ({:?}); sd_listen_fds(3) wants one name each",
            names.len(),
            names.join(":")
        );
    }
    let mut passed = Passed::default();
    let mut unknown = Vec::new();
    for (fd, name) in (LISTEN_FDS_START..LISTEN_FDS_START + n).zip(&names) {
        let slot = match Purpose::of(name) {
            Some(Purpose::Http) => &mut passed.http,
            Some(Purpose::Vsock) => &mut passed.vsock,
            None => {
                unknown.push((fd, *name));
                continue;
            }
        };
        if slot.replace(fd).is_some() {
            anyhow::bail!(
                "systemd passed more than one socket named {name:?} (LISTEN_FDNAMES {:?}): the agent serves one \
                 listener of each kind; leave one ListenStream= in the unit that names its sockets {name:?}",
                names.join(":")
            );
        }
    }
    match unknown[..] {
        [] => {}
        // As before the vsock unit: one socket, named or not, is the TCP listener's.
        [(fd, _)] if n == 1 => passed.http = Some(fd),
        _ => anyhow::bail!(
            "systemd passed sockets named {:?} (LISTEN_FDNAMES): the agent takes one named \"http\" \
             (phq-agent.socket) and one named \"vsock\" (phq-agent-vsock.socket); set FileDescriptorName= in the \
             socket units that pass the others",
            names.join(":")
        ),
    }
    Ok(passed)
}

/// What systemd passed this process, read once; each descriptor is handed out once (`take_passed`).
static PASSED: OnceLock<Result<Mutex<[Option<OwnedFd>; 2]>, String>> = OnceLock::new();

/// The socket systemd passed for `purpose`, if any; the first call reads the environment, and
/// each socket is handed out once (a second call for the same purpose answers `None`).
pub fn take_passed(purpose: Purpose) -> anyhow::Result<Option<OwnedFd>> {
    let passed = PASSED.get_or_init(|| {
        let var = |k: &str| std::env::var(k).ok();
        let p = passed_from(
            var("LISTEN_PID").as_deref(),
            var("LISTEN_FDS").as_deref(),
            var("LISTEN_FDNAMES").as_deref(),
            std::process::id(),
        )
        .map_err(|e| e.to_string())?;
        let own = |fd: Option<RawFd>| -> Result<Option<OwnedFd>, String> {
            let Some(fd) = fd else { return Ok(None) };
            // sd_listen_fds(3) sets FD_CLOEXEC on each: nothing this process starts inherits them.
            // SAFETY: fcntl on a descriptor number; it fails cleanly (EBADF) on one not open.
            if unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) } < 0 {
                return Err(format!("the socket systemd passed (fd {fd}): {}", std::io::Error::last_os_error()));
            }
            // SAFETY: systemd hands this descriptor to this process alone (LISTEN_PID is ours, and
            // it is open: fcntl above succeeded); `PASSED` is made once, so it is owned once.
            Ok(Some(unsafe { OwnedFd::from_raw_fd(fd) }))
        };
        Ok(Mutex::new([own(p.http)?, own(p.vsock)?]))
    });
    let passed = passed.as_ref().map_err(|e| anyhow::anyhow!("LISTEN_FDS from systemd: {e}"))?;
    let mut slots = passed.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    Ok(slots[purpose as usize].take())
}

/// The kind of socket `fd` is: `(SO_DOMAIN, SO_TYPE, SO_ACCEPTCONN)`.
fn socket_kind(fd: RawFd) -> anyhow::Result<(libc::c_int, libc::c_int, bool)> {
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
    Ok((domain, kind, listening != 0))
}

/// Takes the descriptor passed as the vsock listener's, refusing anything but a listening
/// AF_VSOCK stream socket (a TCP socket named `vsock`, a datagram socket, one not listening).
pub fn adopt_vsock(fd: OwnedFd) -> anyhow::Result<VsockListener> {
    let raw = fd.as_raw_fd();
    let (domain, kind, listening) = socket_kind(raw)?;
    if domain != libc::AF_VSOCK || kind != libc::SOCK_STREAM || !listening {
        anyhow::bail!(
            "the socket systemd passed as \"vsock\" (fd {raw}) is not a listening vsock stream socket (domain \
             {domain}, type {kind}, listening {listening}): phq-agent-vsock.socket must say ListenStream=vsock:…"
        );
    }
    Ok(VsockListener::adopt(fd)?)
}

/// Takes the passed descriptor as a listening TCP socket, refusing anything else (a datagram
/// socket, a UNIX or vsock socket, a socket not yet listening).
fn adopt(fd: OwnedFd) -> anyhow::Result<TcpListener> {
    let raw = fd.as_raw_fd();
    let (domain, kind, listening) = socket_kind(raw)?;
    if !matches!(domain, libc::AF_INET | libc::AF_INET6) || kind != libc::SOCK_STREAM || !listening {
        anyhow::bail!(
            "the socket systemd passed (fd {raw}) is not a listening TCP socket (domain {domain}, type {kind}): \
             phq-agent.socket must say ListenStream="
        );
    }
    let std = std::net::TcpListener::from(fd);
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

    fn parse(pid: Option<&str>, fds: Option<&str>, names: Option<&str>) -> anyhow::Result<Passed> {
        passed_from(pid, fds, names, 4242)
    }

    /// sd_listen_fds(3)'s rules: the names say which socket is which, in order from fd 3.
    #[test]
    fn sockets_are_told_apart_by_name() {
        let both = |http, vsock| Passed { http, vsock };
        assert_eq!(parse(Some("4242"), Some("1"), Some("http")).unwrap(), both(Some(3), None));
        assert_eq!(parse(Some("4242"), Some("1"), Some("vsock")).unwrap(), both(None, Some(3)));
        assert_eq!(parse(Some("4242"), Some("2"), Some("http:vsock")).unwrap(), both(Some(3), Some(4)));
        assert_eq!(parse(Some("4242"), Some("2"), Some("vsock:http")).unwrap(), both(Some(4), Some(3)));
        // Without FileDescriptorName= systemd names each after its unit (systemd.socket(5)).
        let units = parse(Some("4242"), Some("2"), Some("phq-agent-vsock.socket:phq-agent.socket")).unwrap();
        assert_eq!(units, both(Some(4), Some(3)));
        // One socket without a name, or with another, is the TCP listener's, as before.
        assert_eq!(parse(Some("4242"), Some("1"), None).unwrap(), both(Some(3), None));
        assert_eq!(parse(Some("4242"), Some("1"), Some("unknown")).unwrap(), both(Some(3), None));
    }

    #[test]
    fn sockets_for_another_process_are_not_ours() {
        assert_eq!(parse(Some("4243"), Some("2"), Some("http:vsock")).unwrap(), Passed::default());
        assert_eq!(parse(None, Some("2"), Some("http:vsock")).unwrap(), Passed::default());
        assert_eq!(parse(Some("4242"), None, None).unwrap(), Passed::default());
    }

    /// What systemd could not have meant is an error that says what it got, never a guess.
    #[test]
    fn names_that_do_not_add_up_are_refused() {
        let refused = [
            (Some("x"), Some("1"), None, "LISTEN_PID"),
            (Some("4242"), Some("two"), None, "LISTEN_FDS"),
            (Some("4242"), Some("0"), None, "LISTEN_FDS"),
            (Some("4242"), Some("-1"), None, "LISTEN_FDS"),
            // Missing names: two sockets, one name; one socket, two names.
            (Some("4242"), Some("2"), Some("http"), "names 1"),
            (Some("4242"), Some("1"), Some("http:vsock"), "names 2"),
            // Two sockets without names the agent knows: which is which cannot be said.
            (Some("4242"), Some("2"), None, "\"unknown:unknown\""),
            (Some("4242"), Some("2"), Some("http:metrics"), "\"http:metrics\""),
            (Some("4242"), Some("2"), Some("http:http"), "more than one socket named \"http\""),
        ];
        for (pid, fds, names, says) in refused {
            let e = parse(pid, fds, names).unwrap_err().to_string();
            assert!(e.contains(says), "{pid:?} {fds:?} {names:?}: {e}");
        }
    }

    /// A listening AF_VSOCK stream socket on a port the kernel picks, when this machine can make
    /// one (the `vsock` module); otherwise the test says so, and fails under CI.
    fn vsock_socket(listen: bool) -> Option<OwnedFd> {
        // SAFETY: plain socket(2); the result is checked before it is owned.
        let raw = unsafe { libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
        if raw < 0 {
            let e = std::io::Error::last_os_error();
            let ci = std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "0" && v != "false");
            assert!(!ci, "this test must run in CI, but socket(AF_VSOCK) fails: {e}");
            eprintln!("SKIPPED the AF_VSOCK part: socket(AF_VSOCK) fails here ({e}); modprobe vsock");
            return None;
        }
        // SAFETY: socket(2) just returned it to this thread alone.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: sockaddr_vm is plain data; zeroes are its reserved fields' required value.
        let mut addr: libc::sockaddr_vm = unsafe { std::mem::zeroed() };
        addr.svm_family = libc::AF_VSOCK as libc::sa_family_t;
        addr.svm_cid = libc::VMADDR_CID_ANY;
        addr.svm_port = libc::VMADDR_PORT_ANY;
        let len = std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t;
        // SAFETY: `addr` is a whole sockaddr_vm and `len` says so.
        assert_eq!(unsafe { libc::bind(raw, (&addr as *const libc::sockaddr_vm).cast(), len) }, 0);
        // SAFETY: listen(2) on the bound socket.
        assert!(!listen || unsafe { libc::listen(raw, 16) } == 0, "{}", std::io::Error::last_os_error());
        Some(fd)
    }

    fn port_of(fd: &OwnedFd) -> u32 {
        // SAFETY: as in `vsock_socket`.
        let mut addr: libc::sockaddr_vm = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t;
        // SAFETY: `addr` and `len` are valid for writes of a sockaddr_vm and its length.
        assert_eq!(
            unsafe { libc::getsockname(fd.as_raw_fd(), (&mut addr as *mut libc::sockaddr_vm).cast(), &mut len) },
            0
        );
        addr.svm_port
    }

    /// Each listener takes only the kind of socket its name says: a TCP socket passed as
    /// "vsock" is refused, and so is a vsock socket passed as "http", a UNIX socket pair, or a
    /// vsock socket that is bound but not listening.
    #[test]
    fn a_passed_socket_of_the_wrong_kind_is_refused() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let _guard = rt.enter();
        let tcp = || OwnedFd::from(std::net::TcpListener::bind("127.0.0.1:0").unwrap());
        let e = adopt_vsock(tcp()).err().expect("a TCP socket is not the vsock listener").to_string();
        assert!(e.contains("not a listening vsock stream socket") && e.contains("phq-agent-vsock.socket"), "{e}");
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let e = adopt_vsock(OwnedFd::from(a)).err().expect("a socket pair is not a listener").to_string();
        assert!(e.contains("not a listening vsock stream socket"), "{e}");
        adopt(tcp()).expect("a listening TCP socket is the TCP listener");
        let Some(vsock) = vsock_socket(true) else { return };
        let e = adopt(vsock).expect_err("a vsock socket is not the TCP listener").to_string();
        assert!(e.contains("not a listening TCP socket"), "{e}");
        let bound = vsock_socket(false).unwrap();
        let e = adopt_vsock(bound).err().expect("a socket not listening is not a listener").to_string();
        assert!(e.contains("listening false"), "{e}");
        // The real thing: adopted with the port it is bound to; another vsock.port is said, not used.
        let vsock = vsock_socket(true).unwrap();
        let want = port_of(&vsock);
        let (l, said) = vsock_listener(Some(vsock), want + 1, |_| panic!("nothing is bound by hand")).unwrap();
        assert_eq!(l.port(), want);
        assert!(said.contains(&format!("vsock port {want}, phq-agent-vsock.socket")), "{said}");
        assert!(said.contains(&format!("vsock.port ({}) names another port", want + 1)), "{said}");
    }

    /// By hand, a vsock port someone holds stops `serve` with `EXIT_PORT_TAKEN` and says what
    /// would have bound it first.
    #[test]
    fn a_held_vsock_port_stops_serve() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let _guard = rt.enter();
        let Some(held) = vsock_socket(true) else { return };
        let port = port_of(&held);
        let e = vsock_listener(None, port, VsockListener::bind).err().expect("the port is held");
        assert!(is_port_taken(&e), "{e:#}");
        let text = e.to_string();
        assert!(text.contains(&format!("vsock port {port}")) && text.contains("phq-agent-vsock.socket"), "{text}");
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
