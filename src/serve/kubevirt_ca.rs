//! KubeVirt's CA bundle as virt-handler serves it: one gRPC call over vsock to the host.
//!
//! KubeVirt's CA rotates (every 24 hours under OpenShift's HCO: a 48-hour CA renewed 24 hours
//! before it expires, `api/v1beta1/hyperconverged_types.go`, mapped by
//! `controllers/handlers/kubevirt.go`), so the bundle cloud-init wrote once stops verifying
//! virt-handler's client certificate within two days. KubeVirt serves the current bundle to its
//! guests for exactly this (the rules below, from `kubevirt/kubevirt`):
//!
//! 1. The service: `kubevirt.vsock.system.v1.System/CABundle`, request `EmptyRequest {}`,
//!    answer `Bundle { bytes Raw = 1; }`: the PEM bundle (`pkg/vsock/system/v1/system.proto`).
//! 2. Where: the host, CID 2 (`VMADDR_CID_HOST`, vsock(7); mdlayher/vsock's `vsock.Host`), port
//!    1 (`cmd/virt-handler/virt-handler.go`: `vsock.NewVSOCKHypervisorService(1, …)`). In
//!    KubeVirt's default ("global") vsock mode virt-handler listens there for as long as the
//!    `VSOCK` gate is on (`pkg/vsock/server/server.go`); in the "local" mode of VEP 222 it
//!    listens only while it dials a guest (`pkg/virt-handler/vsock/servers.go`), which is when
//!    the agent needs the bundle: during a handshake. KubeVirt's example guest agent fetches it
//!    at every handshake (`cmd/example-guest-agent/main.go`, `GetConfigForClient`).
//! 3. How: plain gRPC, HTTP/2 without TLS (`grpc.NewServer()` with no credentials; the example
//!    agent dials `grpc.WithInsecure()`): the bundle is public, and no process in the guest can
//!    answer for CID 2 — a guest's vsock connections to CID 2 go to its host, and a guest
//!    process cannot bind the host's address. So a bundle from here is the platform's, where a
//!    bundle from the guest's network never would be.
//! 4. The wire (gRPC over HTTP/2, grpc/grpc `doc/PROTOCOL-HTTP2.md`): `POST
//!    /kubevirt.vsock.system.v1.System/CABundle`, `content-type: application/grpc`,
//!    `te: trailers`; each message is a compressed flag (0), a 4-byte big-endian length and the
//!    protobuf bytes; the status is `grpc-status` in the trailers (or in the headers of a
//!    trailers-only answer). Protobuf's encoding (protobuf.dev, "Encoding"): field 1 of wire
//!    type 2 is the tag byte 0x0a, a varint length, the bytes.
//!
//! Bounded: the call under a deadline, the answer at most `MAX_ANSWER` bytes. `PHQ_KUBEVIRT_CA_SERVER`
//! names a Unix socket that stands for the host's port 1 (the tests' gRPC server; docs/vsock.md).

use std::time::Duration;

/// The host's vsock address (rule 2).
pub const HOST_CID: u32 = 2;
pub const PORT: u32 = 1;
/// The gRPC method (rules 1 and 4).
pub const METHOD: &str = "/kubevirt.vsock.system.v1.System/CABundle";
/// A Unix socket standing for the host's CA server (tests).
pub const SERVER_ENV: &str = "PHQ_KUBEVIRT_CA_SERVER";
/// The most a bundle's answer may hold: KubeVirt's bundle is a few CA certificates of about
/// 1 KiB each (ECDSA P-256, `triple.NewCA`); 1 MiB bounds a host that answers too much.
pub const MAX_ANSWER: usize = 1 << 20;
/// How long one call may take: our choice — the host is one hop away, so a healthy answer takes
/// milliseconds (3.7 ms measured against the test's grpcio stand-in); a CA server that hangs
/// costs this much of one handshake.
pub const DEADLINE: Duration = Duration::from_secs(5);

/// Whether virt-handler's CA server may be asked from here: the machine's firmware says
/// KubeVirt (KubeVirt's default SMBIOS system: manufacturer and family `KubeVirt`, product
/// `None` — `SmbiosConfigDefaultManufacturer`/`…Family` in kubevirt/kubevirt
/// `pkg/virt-config/virt-config.go`; `checks::host` reads the same), or `SERVER_ENV` names a
/// stand-in. Anywhere else CID 2 is some other host, which the agent has no business calling.
/// A cluster that overrides KubeVirt's SMBIOS (`spec.configuration.smBIOS`) gets no call and
/// lives on cloud-init's bundle (docs/vsock.md).
pub fn askable() -> Result<(), String> {
    if std::env::var_os(SERVER_ENV).is_some_and(|p| !p.is_empty()) {
        return Ok(());
    }
    let root = crate::sysroot::Sysroot::new("/");
    let read =
        |f: &str| root.read_string(&format!("sys/class/dmi/id/{f}")).map(|s| s.trim().to_string()).unwrap_or_default();
    let (vendor, family) = (read("sys_vendor"), read("product_family"));
    if vendor == "KubeVirt" || family == "KubeVirt" {
        return Ok(());
    }
    Err(format!(
        "not asked: this machine's firmware does not say KubeVirt (sys_vendor {vendor:?}, product_family {family:?}), so CID {HOST_CID} is no virt-handler"
    ))
}

/// The PEM bundle virt-handler serves now, or why there is none.
pub async fn fetch() -> Result<Vec<u8>, String> {
    askable()?;
    match tokio::time::timeout(DEADLINE, call()).await {
        Ok(r) => r,
        Err(_) => Err(format!("virt-handler's CA server did not answer within {} s", DEADLINE.as_secs())),
    }
}

/// `fetch` from code that is not async (a TLS handshake's verifier, a thread): on a thread of
/// its own with its own runtime, waited for at most the deadline and a second.
pub fn fetch_blocking() -> Result<Vec<u8>, String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("kubevirt-ca".into())
        .spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build();
            let r = match rt {
                Ok(rt) => rt.block_on(fetch()),
                Err(e) => Err(format!("no runtime for the CA call: {e}")),
            };
            let _ = tx.send(r);
        })
        .map_err(|e| format!("cannot start the CA call's thread: {e}"))?;
    rx.recv_timeout(DEADLINE + Duration::from_secs(1))
        .unwrap_or_else(|_| Err(format!("virt-handler's CA server did not answer within {} s", DEADLINE.as_secs())))
}

/// Where the call goes, in words (the logs and the report).
pub fn server() -> String {
    match std::env::var_os(SERVER_ENV).filter(|p| !p.is_empty()) {
        Some(p) => format!("unix:{} ({SERVER_ENV})", std::path::Path::new(&p).display()),
        None => format!("vsock:{HOST_CID}:{PORT}"),
    }
}

async fn call() -> Result<Vec<u8>, String> {
    let to = server();
    match std::env::var_os(SERVER_ENV).filter(|p| !p.is_empty()) {
        Some(path) => {
            let s = tokio::net::UnixStream::connect(&path).await.map_err(|e| format!("{to}: {e}"))?;
            exchange(s).await.map_err(|e| format!("{to}: {e}"))
        }
        None => {
            let s =
                super::vsock_stream::VsockStream::connect(HOST_CID, PORT).await.map_err(|e| format!("{to}: {e}"))?;
            exchange(s).await.map_err(|e| format!("{to}: {e}"))
        }
    }
}

/// One unary call on `io` (rule 4), over the crate's own HTTP/2 client (`serve::h2c`).
async fn exchange<S>(io: S) -> Result<Vec<u8>, String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    // An empty EmptyRequest: no compression, length 0.
    let answer = super::h2c::post(
        io,
        "localhost",
        METHOD,
        &[("content-type", "application/grpc"), ("te", "trailers")],
        &[0, 0, 0, 0, 0],
        MAX_ANSWER,
    )
    .await
    .map_err(|e| format!("the call failed: {e}"))?;
    if answer.header(":status") != Some("200") {
        return Err(format!("HTTP status {}", answer.header(":status").unwrap_or("(none)")));
    }
    // A trailers-only answer carries the status in its headers.
    if let Some(status) = grpc_status(&answer.headers) {
        status?;
    }
    match grpc_status(&answer.trailers) {
        Some(status) => status?,
        None if grpc_status(&answer.headers).is_none() => return Err("no grpc-status: not a gRPC answer".into()),
        None => {}
    }
    let message = grpc_message(&answer.data)?;
    bundle_field(&message)
}

/// `grpc-status` (0 is OK) with `grpc-message`, when the block has one.
fn grpc_status(h: &[(String, String)]) -> Option<Result<(), String>> {
    let get = |name: &str| h.iter().find(|(k, _)| k == name).map(|(_, v)| v.trim());
    let code = get("grpc-status")?.to_string();
    if code == "0" {
        return Some(Ok(()));
    }
    let text = get("grpc-message").unwrap_or("");
    Some(Err(format!("gRPC status {code} {text}").trim_end().to_string()))
}

/// The one message of a unary answer (rule 4).
fn grpc_message(data: &[u8]) -> Result<Vec<u8>, String> {
    let [flag, a, b, c, d, rest @ ..] = data else {
        return Err(format!("a gRPC message needs 5 bytes of prefix; the answer has {}", data.len()));
    };
    if *flag != 0 {
        return Err("the answer is compressed, which was not asked for".into());
    }
    let len = u32::from_be_bytes([*a, *b, *c, *d]) as usize;
    if rest.len() != len {
        return Err(format!("the message says {len} bytes and {} follow", rest.len()));
    }
    Ok(rest.to_vec())
}

/// Field 1 (`Raw`) of a `Bundle` (rule 1); other fields are skipped as protobuf's encoding
/// lets a reader skip them. An answer without field 1 is an empty bundle (proto3's default).
pub fn bundle_field(mut m: &[u8]) -> Result<Vec<u8>, String> {
    let mut raw = Vec::new();
    while !m.is_empty() {
        let key = varint(&mut m)?;
        let (field, wire) = (key >> 3, key & 7);
        let value: &[u8] = match wire {
            0 => {
                varint(&mut m)?;
                &[]
            }
            1 | 5 => {
                let n = if wire == 1 { 8 } else { 4 };
                let (v, rest) = m.split_at_checked(n).ok_or("a fixed-width field runs past the message")?;
                m = rest;
                v
            }
            2 => {
                let n = usize::try_from(varint(&mut m)?).map_err(|_| "a length past the address space")?;
                let (v, rest) = m.split_at_checked(n).ok_or("a length-delimited field runs past the message")?;
                m = rest;
                v
            }
            w => return Err(format!("wire type {w} is not one a Bundle uses")),
        };
        if field == 1 && wire == 2 {
            raw = value.to_vec();
        }
    }
    Ok(raw)
}

/// A base-128 varint (protobuf "Encoding": at most 10 bytes for 64 bits).
fn varint(m: &mut &[u8]) -> Result<u64, String> {
    let mut v: u64 = 0;
    for i in 0..10 {
        let (&b, rest) = m.split_first().ok_or("a varint runs past the message")?;
        *m = rest;
        v |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err("a varint longer than 10 bytes".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bundle_message_is_read_and_a_broken_one_said() {
        // Bundle { Raw: "PEM" } as protoc encodes it, after an unknown varint field 2.
        let msg = [0x10, 0x96, 0x01, 0x0a, 0x03, b'P', b'E', b'M'];
        assert_eq!(bundle_field(&msg).unwrap(), b"PEM");
        assert_eq!(bundle_field(&[]).unwrap(), b"", "proto3's empty message: an empty bundle");
        assert!(bundle_field(&[0x0a, 0x05, b'x']).unwrap_err().contains("runs past"));
        assert!(bundle_field(&[0x0b]).unwrap_err().contains("wire type 3"));
        let mut framed = vec![0, 0, 0, 0, 8];
        framed.extend_from_slice(&msg);
        assert_eq!(grpc_message(&framed).unwrap(), msg);
        assert!(grpc_message(&framed[..6]).unwrap_err().contains("says 8 bytes"));
        assert!(grpc_message(&[1, 0, 0, 0, 0]).unwrap_err().contains("compressed"));
    }
}
