//! The platform's channel: an AF_VSOCK listener that KubeVirt's `vsock` subresource reaches
//! (virt-handler dials the guest's CID and this port; docs/vsock.md). It serves the same router
//! through the same accept loop as TCP (`http::serve`, rules there), with the peer's CID as the
//! admission key. Rules of its own:
//!
//! 1. No vsock device (the VM has no `autoattachVSOCK`) is not an error: `open` says so in one
//!    line and `serve` runs as without it. A device is one with a guest CID: `/dev/vsock`'s
//!    `IOCTL_VM_SOCKETS_GET_LOCAL_CID` answers `VMADDR_CID_ANY` while no guest transport is
//!    loaded, and a socket can then still be bound, so bind alone cannot tell.
//! 2. TLS 1.3 with a client certificate chained to `vsock.client_ca` is the default
//!    (`tls::vsock_acceptor`): the certificate is what tells the platform from a process in
//!    the guest, which can reach this port too. Plain vsock only when `vsock.tls = false`, and
//!    then the bearer token is required as on TCP (no `ClientCert`).
//! 3. Sockets are made here with libc and driven by tokio's `AsyncFd`: no crate added for two
//!    system calls and a sockaddr.
//!
//! Nothing here reads a sysroot: this is the live process's socket. doctor reads the CID
//! through the sysroot in `collect::host`.

use super::http::{Accept, Peer};
pub use super::vsock_stream::VsockStream;
use super::vsock_stream::{register, sockaddr};
use std::io;
use std::mem::size_of;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use tokio::io::unix::AsyncFd;

/// The live machine's local CID from its vsock device (`path`); `None`: no device, or no guest
/// transport behind it (rule 1).
pub use crate::sysroot::local_cid;

/// Whether a socket or bind error means this machine has no vsock at all (no `vsock` module:
/// EAFNOSUPPORT; no transport behind it: ENODEV; no local CID to bind: EADDRNOTAVAIL).
pub fn means_no_device(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EAFNOSUPPORT | libc::ENODEV | libc::EADDRNOTAVAIL | libc::ESOCKTNOSUPPORT))
}

/// A listening AF_VSOCK stream socket on every local CID.
pub struct VsockListener {
    fd: AsyncFd<OwnedFd>,
    port: u32,
}

impl VsockListener {
    /// Binds `port` on `VMADDR_CID_ANY` and listens with the TCP side's backlog.
    pub fn bind(port: u32) -> io::Result<VsockListener> {
        // SAFETY: plain socket(2); the result is checked before it is owned.
        let raw =
            unsafe { libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC, 0) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a descriptor socket(2) just returned to this thread alone.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let addr = sockaddr(libc::VMADDR_CID_ANY, port);
        // SAFETY: `addr` is a whole sockaddr_vm and the length says so.
        let r = unsafe {
            libc::bind(fd.as_raw_fd(), (&addr as *const libc::sockaddr_vm).cast(), size_of::<libc::sockaddr_vm>() as _)
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: listen(2) on the bound socket.
        if unsafe { libc::listen(fd.as_raw_fd(), super::http::LISTEN_BACKLOG as libc::c_int) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(VsockListener { fd: register(fd)?, port })
    }

    /// Takes a listening AF_VSOCK stream socket made elsewhere (`phq-agent-vsock.socket`, checked
    /// by `port::adopt_vsock`): its port is the one it is bound to (getsockname(2)), and it is
    /// made non-blocking for the reactor.
    pub fn adopt(fd: OwnedFd) -> io::Result<VsockListener> {
        let mut addr = sockaddr(0, 0);
        let mut len = size_of::<libc::sockaddr_vm>() as libc::socklen_t;
        // SAFETY: `addr` and `len` are valid for writes of a sockaddr_vm and its length.
        let r = unsafe { libc::getsockname(fd.as_raw_fd(), (&mut addr as *mut libc::sockaddr_vm).cast(), &mut len) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        if addr.svm_family != libc::AF_VSOCK as libc::sa_family_t {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "not bound to a vsock address"));
        }
        // SAFETY: fcntl(2) on a descriptor this function owns; it fails cleanly if it cannot.
        let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
        // SAFETY: as above.
        if flags < 0 || unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(VsockListener { fd: register(fd)?, port: addr.svm_port })
    }

    pub fn port(&self) -> u32 {
        self.port
    }
}

impl Accept for VsockListener {
    type Stream = VsockStream;
    async fn accept(&self) -> io::Result<(VsockStream, Peer)> {
        loop {
            let mut guard = self.fd.readable().await?;
            match guard.try_io(|fd| accept(fd.get_ref().as_raw_fd())) {
                Ok(Ok((stream, cid))) => return Ok((VsockStream::adopt(stream)?, Peer::Cid(cid))),
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        }
    }
}

/// accept4(2) with the peer's address; the new socket non-blocking, closed on exec.
fn accept(listener: RawFd) -> io::Result<(OwnedFd, u32)> {
    let mut addr = sockaddr(0, 0);
    let mut len = size_of::<libc::sockaddr_vm>() as libc::socklen_t;
    // SAFETY: `addr` and `len` are valid for writes of a sockaddr_vm and its length.
    let raw = unsafe {
        libc::accept4(
            listener,
            (&mut addr as *mut libc::sockaddr_vm).cast(),
            &mut len,
            libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
        )
    };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: accept4 just returned this descriptor to this thread alone.
    Ok((unsafe { OwnedFd::from_raw_fd(raw) }, addr.svm_cid))
}

#[cfg(test)]
mod tests;
