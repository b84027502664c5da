//! Pushing reports to the platform: `POST {platform.url}/v1/agents/{agent_id}/reports`.
//!
//! The rules of the loop:
//! 1. One request in flight at a time. Spooled events go before periodic status.
//! 2. An event (an Xid, a finding changing severity) is written to the spool —
//!    `state_dir/spool/<seq>.json`, written to a temporary name, fsynced, renamed, directory
//!    fsynced — before anything tries to send it, and deleted only after the platform answered
//!    2xx. A crash between the two sends it again: at least once. `Idempotency-Key:
//!    {agent_id}:{epoch}:{seq}` lets the platform drop the repeat. The epoch is random per start
//!    of the agent and kept in the spooled file's name, so a repeat keeps its key while a new
//!    event can never reuse an old one — not after a lost `seq` file, nor after the VM is
//!    restored from a snapshot and counts the same numbers again.
//! 3. Events leave in seq order: the oldest spooled event is retried until it is accepted, and
//!    nothing overtakes it.
//! 4. Periodic status is latest-wins and never spooled: while the platform is away, a newer
//!    status replaces the waiting one.
//! 5. Failures back off exponentially (0.5 s doubling to `MAX_BACKOFF`) with jitter, so a fleet
//!    of agents does not hammer a recovering platform in step.
//! 6. A 4xx other than 408/429 is a refusal, not an outage: a refused event is moved to
//!    `spool/refused/` (kept, logged, never silently dropped) so it cannot block the queue.
//! 7. Redirects are never followed. A 3xx is an error, retried and logged, and the event stays
//!    spooled: following one would turn a POST into a GET (302/303, so a login page's 200
//!    "accepts" an event that never arrived), send reports and the bearer token to another
//!    origin (307/308), or downgrade HTTPS to plain HTTP. curl follows none unless told to
//!    (`-L`), and then drops credentials on a change of host; Go's net/http drops them on a
//!    change of domain. The platform's URL is configuration: if it moves, change
//!    `platform.url`.
//! 8. A `Retry-After` on 429 or 503 (RFC 9110 §10.2.3: seconds, or an HTTP date) is honoured,
//!    capped at `MAX_RETRY_AFTER`, when it asks for longer than the backoff.
//! 9. The spool is bounded in bytes (`MAX_SPOOL_BYTES`), as journald bounds its files: an
//!    event that would pass the bound is not written, and is counted (`dropped`, in every
//!    report's `agent.events` and in a metric) rather than lost without a word. Repeats are
//!    merged before they get here (serve's Xid window), so a storm of Xids is a handful of
//!    events, each carrying only what it is about: the bound is met only by a platform away for
//!    a long time. The spool keeps its index in memory, so a write costs one file, not a listing
//!    of the directory.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

pub const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// The longest wait a platform's `Retry-After` can impose: our own cap, so a misconfigured
/// proxy cannot silence the agent for a day.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(600);
/// The spool's bound in bytes. An Xid event report is a few KB, so this holds thousands of
/// events: hours of a platform outage with a failing GPU. Our own bound, well under journald's
/// default cap of 4 GiB for its files (journald.conf(5), `SystemMaxUse=`).
pub const MAX_SPOOL_BYTES: u64 = 64 << 20;
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// The on-disk queue of events, and its index in memory (shared by the writer and the pusher).
#[derive(Debug, Clone)]
pub struct Spool {
    dir: PathBuf,
    /// This run's epoch: new events are spooled under it.
    epoch: String,
    max_bytes: u64,
    index: Arc<std::sync::Mutex<Index>>,
}

#[derive(Debug, Default)]
struct Index {
    /// Spooled events by seq: (epoch, bytes).
    events: std::collections::BTreeMap<u64, (String, u64)>,
    bytes: u64,
}

/// A spooled event: its seq, the epoch it was spooled under, its file.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Spooled {
    pub seq: u64,
    pub epoch: String,
    pub path: PathBuf,
}

/// What became of an event handed to `Spool::put`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Put {
    Stored,
    /// Not written: the spool is at its byte bound.
    Full,
}

/// A new epoch: 16 hex digits from the kernel's random source (the clock and pid if that
/// fails, which still differ from any earlier run's).
pub fn new_epoch() -> String {
    let mut bytes = [0u8; 8];
    let random = std::fs::File::open("/dev/urandom").and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes));
    if random.is_err() {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        bytes = (now.as_nanos() as u64 ^ (u64::from(std::process::id()) << 32)).to_le_bytes();
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl Spool {
    pub fn open(state_dir: &Path, epoch: &str) -> std::io::Result<Spool> {
        Spool::open_bounded(state_dir, epoch, MAX_SPOOL_BYTES)
    }

    /// `open` with another byte bound (tests).
    pub fn open_bounded(state_dir: &Path, epoch: &str, max_bytes: u64) -> std::io::Result<Spool> {
        let dir = state_dir.join("spool");
        std::fs::create_dir_all(dir.join("refused"))?;
        let mut index = Index::default();
        for e in entries_in(&dir) {
            let bytes = std::fs::symlink_metadata(&e.path).map(|m| m.len()).unwrap_or(0);
            index.bytes += bytes;
            index.events.insert(e.seq, (e.epoch, bytes));
        }
        Ok(Spool { dir, epoch: epoch.to_string(), max_bytes, index: Arc::new(std::sync::Mutex::new(index)) })
    }

    fn index(&self) -> std::sync::MutexGuard<'_, Index> {
        self.index.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn path_of(&self, seq: u64, epoch: &str) -> PathBuf {
        if epoch == "0" {
            self.dir.join(format!("{seq:020}.json")) // spooled before epochs
        } else {
            self.dir.join(format!("{seq:020}-{epoch}.json"))
        }
    }

    pub fn epoch(&self) -> &str {
        &self.epoch
    }

    /// The highest seq in the spool, refused events included: where a lost `seq` file resumes.
    pub fn highest_seq(state_dir: &Path) -> Option<u64> {
        let dir = state_dir.join("spool");
        [entries_in(&dir), entries_in(&dir.join("refused"))].into_iter().flatten().map(|e| e.seq).max()
    }

    /// Writes an event durably, unless the spool is at its byte bound. Returns once it is on
    /// disk.
    pub fn put(&self, seq: u64, body: &[u8]) -> std::io::Result<Put> {
        let size = body.len() as u64;
        if self.index().bytes + size > self.max_bytes {
            return Ok(Put::Full);
        }
        crate::durable::write(&self.path_of(seq, &self.epoch), body, 0o666)?;
        let mut index = self.index();
        index.bytes += size;
        index.events.insert(seq, (self.epoch.clone(), size));
        Ok(Put::Stored)
    }

    /// The oldest event.
    pub fn oldest(&self) -> Option<Spooled> {
        let index = self.index();
        let (seq, (epoch, _)) = index.events.iter().next()?;
        Some(Spooled { seq: *seq, epoch: epoch.clone(), path: self.path_of(*seq, epoch) })
    }

    pub fn len(&self) -> usize {
        self.index().events.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes the spool holds.
    pub fn bytes(&self) -> u64 {
        self.index().bytes
    }

    fn forget(&self, seq: u64) {
        let mut index = self.index();
        if let Some((_, size)) = index.events.remove(&seq) {
            index.bytes -= size;
        }
    }

    /// Delivered: the event leaves the spool. False when its file could not be removed (it is
    /// then sent again after a restart, which the Idempotency-Key makes harmless).
    pub fn remove(&self, e: &Spooled) -> bool {
        self.forget(e.seq);
        match std::fs::remove_file(&e.path) {
            Ok(()) => true,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => true,
            Err(err) => {
                tracing::error!(path = %e.path.display(), error = %err, "delivered, but cannot remove it from the spool; it will be sent again");
                false
            }
        }
    }

    /// Refused for good, or unreadable: moved to `refused/`, out of the queue.
    fn refuse(&self, e: &Spooled) {
        self.forget(e.seq);
        if let Some(name) = e.path.file_name() {
            let _ = std::fs::rename(&e.path, self.dir.join("refused").join(name));
        }
    }
}

/// The spooled events in `dir`, oldest first: `<seq>-<epoch>.json`, or `<seq>.json` as spooled
/// before epochs (epoch `0`).
fn entries_in(dir: &Path) -> Vec<Spooled> {
    let mut v: Vec<Spooled> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter_map(|e| {
                    let name = e.file_name().to_string_lossy().into_owned();
                    let stem = name.strip_suffix(".json")?;
                    let (seq, epoch) = stem.split_once('-').unwrap_or((stem, "0"));
                    let epoch_ok = !epoch.is_empty() && epoch.bytes().all(|b| b.is_ascii_hexdigit());
                    epoch_ok.then_some(())?;
                    Some(Spooled { seq: seq.parse().ok()?, epoch: epoch.to_string(), path: e.path() })
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// What `deliver` learned from one attempt.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Accepted,
    /// Try again later (connection failure, timeout, 5xx, 408, 429, a redirect), not before
    /// the platform's `Retry-After` when it gave one.
    Retry(String, Option<Duration>),
    /// The platform refuses this report for good (other 4xx).
    Refused(String),
}

pub struct Pusher {
    /// Shared with the snapshot task for agent.platform-reachable.
    pub state: Arc<std::sync::Mutex<super::agent_checks::PushState>>,
    client: reqwest::Client,
    url: String,
    agent_id: String,
    token_file: PathBuf,
    spool: Spool,
}

impl Pusher {
    pub fn new(config: &crate::config::PlatformConfig, agent_id: &str, spool: Spool) -> anyhow::Result<Pusher> {
        let mut builder = reqwest::Client::builder()
            .timeout(REQUEST_TIMEOUT)
            .connect_timeout(REQUEST_TIMEOUT)
            .redirect(reqwest::redirect::Policy::none()); // rule 7
        if !config.ca_file.is_empty() {
            let pem = std::fs::read(&config.ca_file)
                .map_err(|e| anyhow::anyhow!("{} (platform.ca_file): {e}", config.ca_file))?;
            let cert = reqwest::Certificate::from_pem(&pem)
                .map_err(|e| anyhow::anyhow!("{} (platform.ca_file): not a PEM certificate: {e}", config.ca_file))?;
            builder = builder.add_root_certificate(cert);
        }
        let url = format!("{}/v1/agents/{}/reports", config.url.trim_end_matches('/'), agent_id);
        Ok(Pusher {
            state: Default::default(),
            client: builder.build()?,
            url,
            agent_id: agent_id.to_string(),
            token_file: config.token_file.clone(),
            spool,
        })
    }

    async fn deliver(&self, seq: u64, epoch: &str, body: bytes::Bytes) -> Outcome {
        // Read each time: a token rotated on disk is used from the next attempt on.
        let token = match std::fs::read_to_string(&self.token_file) {
            Ok(t) => t.trim().to_string(),
            Err(e) => return Outcome::Retry(format!("{} (platform.token_file): {e}", self.token_file.display()), None),
        };
        let sent = self
            .client
            .post(&self.url)
            .bearer_auth(token)
            .header("Idempotency-Key", format!("{}:{epoch}:{seq}", self.agent_id))
            .header("Content-Type", "application/json")
            .body(body)
            .send()
            .await;
        match sent {
            Err(e) => Outcome::Retry(format!("POST {}: {e}", self.url), None),
            Ok(r) if r.status().is_success() => Outcome::Accepted,
            Ok(r) if r.status().is_redirection() => {
                let to = r.headers().get(reqwest::header::LOCATION).and_then(|v| v.to_str().ok()).unwrap_or("nowhere");
                Outcome::Retry(
                    format!(
                        "POST {}: {} to {to:?}, not followed (set platform.url to where the platform is)",
                        self.url,
                        r.status()
                    ),
                    None,
                )
            }
            Ok(r) if r.status().is_server_error() || r.status() == 408 || r.status() == 429 => {
                let after =
                    r.headers().get(reqwest::header::RETRY_AFTER).and_then(|v| v.to_str().ok()).and_then(retry_after);
                Outcome::Retry(format!("POST {}: {}", self.url, r.status()), after)
            }
            Ok(r) => Outcome::Refused(format!("POST {}: {}", self.url, r.status())),
        }
    }

    /// Runs until `stop` fires. `status` carries the latest periodic report (seq, body);
    /// `wake` is notified whenever an event was spooled.
    pub async fn run(
        self,
        mut status: tokio::sync::watch::Receiver<Option<(u64, bytes::Bytes)>>,
        wake: Arc<tokio::sync::Notify>,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) {
        let mut backoff = Duration::ZERO;
        let mut pending_status: Option<(u64, bytes::Bytes)> = None;
        loop {
            if *stop.borrow() {
                return;
            }
            if !backoff.is_zero() {
                tokio::select! {
                    _ = tokio::time::sleep(jittered(backoff)) => {}
                    _ = stop.changed() => return,
                }
            }
            if status.has_changed().unwrap_or(false) {
                pending_status = status.borrow_and_update().clone();
            }
            let attempt = if let Some(e) = self.spool.oldest() {
                match crate::sysroot::read_regular(&e.path, true, MAX_SPOOL_BYTES) {
                    Ok(body) => Some((e.seq, e.epoch.clone(), bytes::Bytes::from(body), Some(e))),
                    Err(err) => {
                        tracing::error!(path = %e.path.display(), error = %err, "unreadable spooled event; moving it aside");
                        self.spool.refuse(&e);
                        continue;
                    }
                }
            } else {
                pending_status.take().map(|(seq, body)| (seq, self.spool.epoch().to_string(), body, None))
            };
            let Some((seq, epoch, body, spooled)) = attempt else {
                backoff = Duration::ZERO;
                tokio::select! {
                    _ = wake.notified() => {}
                    // `changed()` marks the new value seen, so take it here: `has_changed()` at
                    // the top of the loop would say false and the status would wait for the next.
                    r = status.changed() => {
                        if r.is_ok() {
                            pending_status = status.borrow_and_update().clone();
                        }
                    }
                    _ = stop.changed() => return,
                }
                continue;
            };
            let outcome = self.deliver(seq, &epoch, body.clone()).await;
            if let Ok(mut st) = self.state.lock() {
                match &outcome {
                    Outcome::Accepted => {
                        st.last_accepted = Some(crate::snapshot::Timestamp::now());
                        st.failing = None;
                        st.last_refusal = None;
                    }
                    Outcome::Retry(why, _) => {
                        let since = st.failing.as_ref().map(|f| f.0).unwrap_or_else(crate::snapshot::Timestamp::now);
                        st.failing = Some((since, why.clone()));
                    }
                    Outcome::Refused(why) => st.last_refusal = Some(why.clone()),
                }
                st.spooled = self.spool.len();
            }
            match outcome {
                Outcome::Accepted => {
                    backoff = Duration::ZERO;
                    if let Some(e) = spooled {
                        self.spool.remove(&e);
                    }
                }
                Outcome::Retry(why, after) => {
                    backoff = (backoff * 2).clamp(Duration::from_millis(500), MAX_BACKOFF);
                    if let Some(after) = after.filter(|a| *a > backoff) {
                        backoff = after; // rule 8: jitter takes up to half of it off, as for any wait
                    }
                    tracing::warn!(seq, retry_in = ?backoff, "platform unreachable: {why}");
                    if spooled.is_none() && pending_status.is_none() {
                        pending_status = Some((seq, body)); // a newer status will replace it
                    }
                }
                Outcome::Refused(why) => {
                    backoff = Duration::ZERO;
                    match spooled {
                        Some(e) => {
                            tracing::error!(seq, path = %e.path.display(), "platform refused an event: {why}; kept in spool/refused");
                            self.spool.refuse(&e);
                        }
                        None => tracing::error!(seq, "platform refused a status report: {why}"),
                    }
                }
            }
        }
    }
}

/// A `Retry-After` value (RFC 9110 §10.2.3): delay-seconds or an HTTP date, capped at
/// `MAX_RETRY_AFTER`; None when it is neither.
fn retry_after(v: &str) -> Option<Duration> {
    let wait = match v.trim().parse::<u64>() {
        Ok(secs) => Duration::from_secs(secs),
        Err(_) => {
            let at = humantime::parse_rfc3339_weak(v.trim()).ok().or_else(|| httpdate(v.trim()))?;
            at.duration_since(std::time::SystemTime::now()).unwrap_or(Duration::ZERO)
        }
    };
    Some(wait.min(MAX_RETRY_AFTER))
}

/// An IMF-fixdate (`Sun, 06 Nov 1994 08:49:37 GMT`), the form RFC 9110 requires senders to use.
fn httpdate(v: &str) -> Option<std::time::SystemTime> {
    let mut w = v.split_whitespace();
    let (_, day, month, year, time, zone) = (w.next()?, w.next()?, w.next()?, w.next()?, w.next()?, w.next()?);
    if zone != "GMT" || w.next().is_some() {
        return None;
    }
    let months = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"];
    let month = months.iter().position(|m| *m == month)? + 1;
    humantime::parse_rfc3339(&format!("{year}-{month:02}-{:02}T{time}Z", day.parse::<u32>().ok()?)).ok()
}

/// Between half and all of `d`, from the clock's low bits: enough spread that agents that
/// failed together do not retry together.
fn jittered(d: Duration) -> Duration {
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|t| t.subsec_nanos()).unwrap_or(0);
    let frac = 0.5 + (nanos % 1000) as f64 / 2000.0;
    d.mul_f64(frac)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spool_orders_by_seq_and_survives_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let s = Spool::open(dir.path(), "00aa").unwrap();
        s.put(10, b"ten").unwrap();
        s.put(9, b"nine").unwrap();
        // A later run spools under its own epoch; the order is still by seq.
        let s = Spool::open(dir.path(), "00bb").unwrap();
        s.put(100, b"hundred").unwrap();
        assert_eq!(s.len(), 3);
        let oldest = s.oldest().unwrap();
        assert_eq!((oldest.seq, oldest.epoch.as_str()), (9, "00aa"), "a repeat keeps the epoch it was spooled under");
        assert_eq!(std::fs::read(&oldest.path).unwrap(), b"nine");
        s.refuse(&oldest);
        assert_eq!(s.oldest().unwrap().seq, 10);
        assert!(dir.path().join("spool/refused/00000000000000000009-00aa.json").exists());
        assert_eq!(Spool::highest_seq(dir.path()), Some(100));
        // Files spooled before epochs existed are still sent (epoch 0); strangers are ignored.
        std::fs::write(dir.path().join("spool/00000000000000000001.json"), b"old").unwrap();
        std::fs::write(dir.path().join("spool/notes.json"), b"?").unwrap();
        std::fs::write(dir.path().join("spool/00000000000000000002-zz.json"), b"?").unwrap();
        let s = Spool::open(dir.path(), "00cc").unwrap();
        let oldest = s.oldest().unwrap();
        assert_eq!((oldest.seq, oldest.epoch.as_str(), s.len()), (1, "0", 3));
        assert!(oldest.path.ends_with("00000000000000000001.json"));
        assert_eq!(s.bytes(), 3 + 3 + 7);
        assert!(s.remove(&oldest));
        assert_eq!((s.len(), s.bytes()), (2, 10));
    }

    #[test]
    fn the_spool_is_bounded_in_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let s = Spool::open_bounded(dir.path(), "e1", 10).unwrap();
        assert_eq!(s.put(1, b"12345").unwrap(), Put::Stored);
        assert_eq!(s.put(2, b"12345").unwrap(), Put::Stored);
        assert_eq!(s.put(3, b"1").unwrap(), Put::Full);
        assert_eq!((s.len(), s.bytes()), (2, 10));
        // The bound holds across a restart: the index is rebuilt from the files.
        let s = Spool::open_bounded(dir.path(), "e2", 10).unwrap();
        assert_eq!((s.len(), s.bytes()), (2, 10));
        assert_eq!(s.put(4, b"1").unwrap(), Put::Full);
        let e = s.oldest().unwrap();
        s.remove(&e);
        assert_eq!(s.put(4, b"1").unwrap(), Put::Stored);
    }

    /// A status sent while the pusher is idle, waiting, is delivered (it once waited for the
    /// next one, which met the same fate: periodic status never arrived).
    #[test]
    fn a_status_sent_to_an_idle_pusher_is_delivered() {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for mut conn in listener.incoming().flatten() {
                let mut buf = [0u8; 65536];
                let n = conn.read(&mut buf).unwrap_or(0);
                let _ = tx.send(String::from_utf8_lossy(&buf[..n]).into_owned());
                let _ = conn.write_all(b"HTTP/1.1 202 Accepted\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
            }
        });
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("token"), "platform-token\n").unwrap();
        let config = crate::config::PlatformConfig {
            url: format!("http://127.0.0.1:{port}"),
            token_file: dir.path().join("token"),
            ..Default::default()
        };
        let pusher = Pusher::new(&config, "vm-1", Spool::open(dir.path(), "e1").unwrap()).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let (status_tx, status_rx) = tokio::sync::watch::channel(None);
            let (_stop_tx, stop_rx) = tokio::sync::watch::channel(false);
            let task = tokio::spawn(pusher.run(status_rx, Arc::new(tokio::sync::Notify::new()), stop_rx));
            tokio::time::sleep(Duration::from_millis(200)).await; // idle, waiting for work
            status_tx.send(Some((7, bytes::Bytes::from_static(b"{\"seq\":7}")))).unwrap();
            let got = tokio::task::spawn_blocking(move || rx.recv_timeout(Duration::from_secs(5))).await.unwrap();
            let request = got.expect("the status was never delivered");
            assert!(request.starts_with("POST /v1/agents/vm-1/reports"), "{request}");
            task.abort();
        });
    }

    /// A platform double for one kind of answer: every request it gets (request line and
    /// headers) goes to the channel; a POST is answered with `answer`'s head, anything else
    /// (the GET a followed 302 becomes) with a login page's 200.
    fn double(answer: String) -> (u16, std::sync::mpsc::Receiver<String>) {
        use std::io::{BufRead, BufReader, Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let mut r = BufReader::new(conn.try_clone().unwrap());
                let (mut head, mut len) = (String::new(), 0usize);
                loop {
                    let mut line = String::new();
                    if r.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                        break;
                    }
                    if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                        len = v.trim().parse().unwrap_or(0);
                    }
                    head.push_str(&line);
                }
                let mut body = vec![0u8; len];
                let _ = r.read_exact(&mut body);
                let answer = if head.starts_with("POST ") { answer.as_str() } else { "HTTP/1.1 200 OK\r\n" };
                let _ = tx.send(head);
                let mut conn = conn;
                let _ = conn.write_all(format!("{answer}Content-Length: 0\r\nConnection: close\r\n\r\n").as_bytes());
            }
        });
        (port, rx)
    }

    fn pusher_for(url: String, dir: &Path) -> Pusher {
        std::fs::write(dir.join("token"), "platform-secret\n").unwrap();
        let config = crate::config::PlatformConfig { url, token_file: dir.join("token"), ..Default::default() };
        Pusher::new(&config, "vm-1", Spool::open(dir, "e1").unwrap()).unwrap()
    }

    fn deliver_once(p: &Pusher) -> Outcome {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(p.deliver(1, "e1", bytes::Bytes::from_static(b"{}")))
    }

    /// Every redirect is an error to retry: the event is not sent on, the token goes nowhere
    /// else, and the POST never becomes a GET.
    #[test]
    fn redirects_are_never_followed() {
        let (elsewhere, elsewhere_got) = double("HTTP/1.1 200 OK\r\n".into());
        for (status, location) in [
            ("302 Found", "/login".to_string()),
            ("303 See Other", "/login".to_string()),
            ("307 Temporary Redirect", format!("http://127.0.0.1:{elsewhere}/v1/agents/vm-1/reports")),
            ("308 Permanent Redirect", format!("http://localhost:{elsewhere}/v1/agents/vm-1/reports")),
        ] {
            let (port, got) = double(format!("HTTP/1.1 {status}\r\nLocation: {location}\r\n"));
            let dir = tempfile::tempdir().unwrap();
            let outcome = deliver_once(&pusher_for(format!("http://127.0.0.1:{port}"), dir.path()));
            match &outcome {
                Outcome::Retry(why, None) => assert!(why.contains("not followed") && why.contains(&location), "{why}"),
                other => panic!("{status}: {other:?}"),
            }
            let first = got.recv_timeout(Duration::from_secs(5)).unwrap();
            assert!(first.starts_with("POST /v1/agents/vm-1/reports"), "{first}");
            assert!(got.recv_timeout(Duration::from_millis(300)).is_err(), "{status}: a second request followed");
        }
        assert!(elsewhere_got.recv_timeout(Duration::from_millis(300)).is_err(), "a report reached another origin");
    }

    /// An HTTPS platform that redirects to plain HTTP gets nothing sent in clear text.
    #[test]
    fn an_https_platform_redirecting_to_http_gets_no_token_in_clear() {
        let (plain, plain_got) = double("HTTP/1.1 202 Accepted\r\n".into());
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["localhost".to_string()]).unwrap().self_signed(&key).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let (cert_pem, key_pem) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
        std::fs::write(&cert_pem, cert.pem()).unwrap();
        std::fs::write(&key_pem, key.serialize_pem()).unwrap();
        let http = crate::config::HttpConfig {
            tls_cert: cert_pem.display().to_string(),
            tls_key: key_pem.display().to_string(),
            ..Default::default()
        };
        let acceptor = crate::serve::tls::acceptor(&http).unwrap().unwrap();
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
        let port = listener.local_addr().unwrap().port();
        let (tx, https_got) = std::sync::mpsc::channel();
        rt.spawn(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            while let Ok((tcp, _)) = listener.accept().await {
                let Ok(mut tls) = acceptor.accept(tcp).await else { continue };
                let mut buf = vec![0u8; 65536];
                let n = tls.read(&mut buf).await.unwrap_or(0);
                let _ = tx.send(String::from_utf8_lossy(&buf[..n]).into_owned());
                let answer = format!(
                    "HTTP/1.1 307 Temporary Redirect\r\nLocation: http://127.0.0.1:{plain}/v1/agents/vm-1/reports\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                );
                let _ = tls.write_all(answer.as_bytes()).await;
                let _ = tls.shutdown().await;
            }
        });
        std::fs::write(dir.path().join("token"), "platform-secret\n").unwrap();
        let config = crate::config::PlatformConfig {
            url: format!("https://localhost:{port}"),
            token_file: dir.path().join("token"),
            ca_file: cert_pem.display().to_string(),
            ..Default::default()
        };
        let pusher = Pusher::new(&config, "vm-1", Spool::open(dir.path(), "e1").unwrap()).unwrap();
        let outcome = rt.block_on(pusher.deliver(1, "e1", bytes::Bytes::from_static(b"{}")));
        assert!(matches!(&outcome, Outcome::Retry(why, _) if why.contains("307")), "{outcome:?}");
        let got = https_got.recv_timeout(Duration::from_secs(5)).unwrap();
        assert!(got.contains("authorization: Bearer platform-secret"), "the HTTPS platform got the token: {got}");
        assert!(plain_got.recv_timeout(Duration::from_millis(500)).is_err(), "something went out in clear text");
    }

    #[test]
    fn retry_after_is_read_as_seconds_or_a_date_and_capped() {
        assert_eq!(retry_after("120"), Some(Duration::from_secs(120)));
        assert_eq!(retry_after("86400"), Some(MAX_RETRY_AFTER));
        assert_eq!(retry_after("Sun, 06 Nov 1994 08:49:37 GMT"), Some(Duration::ZERO), "a date in the past");
        let soon = httpdate("Tue, 01 Dec 2099 00:00:00 GMT").unwrap();
        assert!(soon > std::time::SystemTime::now());
        assert_eq!(retry_after("soon"), None);
    }

    #[test]
    fn a_503_with_retry_after_waits_as_asked() {
        let (port, _got) = double("HTTP/1.1 503 Service Unavailable\r\nRetry-After: 42\r\n".into());
        let dir = tempfile::tempdir().unwrap();
        let outcome = deliver_once(&pusher_for(format!("http://127.0.0.1:{port}"), dir.path()));
        assert!(matches!(outcome, Outcome::Retry(_, Some(d)) if d == Duration::from_secs(42)), "{outcome:?}");
    }

    #[test]
    fn jitter_stays_within_half_and_whole() {
        for _ in 0..100 {
            let j = jittered(Duration::from_secs(10));
            assert!(j >= Duration::from_secs(5) && j <= Duration::from_secs(10));
        }
    }
}
