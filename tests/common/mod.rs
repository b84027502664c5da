//! Test parts shared by the black-box tests: the fake NVML library, a private `dbus-daemon`
//! carrying a small systemd stand-in, and running the real binary.
#![allow(dead_code)]

pub mod debian;
pub mod el9;
pub mod install;

use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use zbus::zvariant::OwnedObjectPath;

pub fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Whether this is CI's run, where every test must run: `.ci/run` sets `CI=true` and installs
/// every tool the tests drive.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "0" && v != "false")
}

/// A test that cannot run here says so where a person sees it. Under CI it fails instead.
/// Elsewhere the reason goes to stderr and to `target/phq-test-skips/`, which `scripts/test`
/// lists at the end of the run (libtest shows nothing a passing test printed). The caller
/// returns right after: `if !needs(..) { return; }`.
#[track_caller]
pub fn skip(why: &str) {
    let test = std::thread::current().name().unwrap_or("?").to_string();
    let crate_name = env!("CARGO_CRATE_NAME");
    assert!(!in_ci(), "{crate_name}::{test} must run in CI, but: {why}");
    eprintln!("SKIPPED {crate_name}::{test}: {why}");
    let dir = repo().join("target/phq-test-skips");
    if std::fs::create_dir_all(&dir).is_ok() {
        let _ = std::fs::write(dir.join(format!("{crate_name}.{test}.txt")), format!("{crate_name}::{test} — {why}\n"));
    }
}

/// Whether a program is on PATH (or in the sbin directories a non-root PATH may lack).
pub fn have(tool: &str) -> bool {
    std::env::var_os("PATH").map(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file())).unwrap_or(false)
        || ["/usr/sbin", "/sbin"].iter().any(|d| Path::new(d).join(tool).is_file())
}

/// The tools a test drives, each with the Debian package that brings it; a skip naming the
/// missing ones otherwise (`scripts/test` installs them all).
#[track_caller]
pub fn needs(tools: &[(&str, &str)]) -> bool {
    let missing: Vec<String> =
        tools.iter().filter(|(t, _)| !have(t)).map(|(t, pkg)| format!("{t} (apt-get install {pkg})")).collect();
    if missing.is_empty() {
        return true;
    }
    skip(&format!("needs {}", missing.join(", ")));
    false
}

/// The fake NVML library, built once per test binary; `PHQ_FAKE_NVML_LIB` names a prebuilt one.
pub fn fake_nvml() -> &'static Path {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| fake_library("fake-nvml", "PHQ_FAKE_NVML_LIB"))
}

/// The fake CUDA driver (crates/fake-cuda: libcuda and libcublas in one library), built once per
/// test binary; `PHQ_FAKE_CUDA_LIB` names a prebuilt one.
pub fn fake_cuda() -> &'static Path {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| fake_library("fake-cuda", "PHQ_FAKE_CUDA_LIB"))
}

/// A fake's cdylib: the file `env` names, else built (cargo does not build a workspace member's
/// cdylib for another package's tests).
fn fake_library(package: &str, env: &str) -> PathBuf {
    if let Ok(p) = std::env::var(env) {
        return PathBuf::from(p);
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(cargo)
        .args(["build", "--quiet", "-p", package])
        .current_dir(repo())
        .status()
        .unwrap_or_else(|e| panic!("run cargo build -p {package}: {e}"));
    assert!(status.success(), "cargo build -p {package} failed");
    let target = std::env::var("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|_| repo().join("target"));
    target.join(format!("debug/lib{}.so", package.replace('-', "_")))
}

/// The platform's poller (crates/phq-platform), built once per test binary: cargo builds another
/// package's binary for this one's tests only when asked.
pub fn platform_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let ok =
            Command::new(cargo).args(["build", "--quiet", "-p", "phq-platform"]).current_dir(repo()).status().unwrap();
        assert!(ok.success(), "cargo build -p phq-platform");
        let target = std::env::var("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|_| repo().join("target"));
        target.join("debug/phq-platform")
    })
}

/// The TCP port `child` listens on, once it does, or None if it exits first (its stderr is
/// left for the caller). The test gives the agent `127.0.0.1:0` and reads the port the kernel
/// chose from /proc (the socket inodes among the child's descriptors against the LISTEN rows of
/// its tcp tables): no port is picked, dropped and hoped for.
pub fn listening_port(child: &mut Child) -> Option<u16> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        if let Some(port) = listening_ports(child.id()).first() {
            return Some(*port);
        }
        if let Ok(Some(_)) = child.try_wait() {
            return None;
        }
        assert!(std::time::Instant::now() < deadline, "pid {} listened on no TCP port within 30 s", child.id());
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// The TCP ports process `pid` is listening on (IPv4 and IPv6).
pub fn listening_ports(pid: u32) -> Vec<u16> {
    let inodes: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.flatten()
                .filter_map(|e| std::fs::read_link(e.path()).ok())
                .filter_map(|l| l.to_str()?.strip_prefix("socket:[")?.strip_suffix(']').map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    let mut ports = vec![];
    for table in ["tcp", "tcp6"] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).unwrap_or_default();
        for row in text.lines().skip(1) {
            let cols: Vec<&str> = row.split_whitespace().collect();
            // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode; 0A = LISTEN
            if cols.len() > 9 && cols[3] == "0A" && inodes.iter().any(|i| i == cols[9]) {
                if let Some(port) = cols[1].rsplit(':').next().and_then(|h| u16::from_str_radix(h, 16).ok()) {
                    ports.push(port);
                }
            }
        }
    }
    ports
}

/// In `dir`: the HTTP token `token` (0600) and a config for the service — state in `dir/state`,
/// listening on a port the kernel picks — with `extra` TOML appended. Returns the config's path.
/// The control token `service_config` writes beside the read token `token`: it starts work.
pub fn control_token_of(token: &str) -> String {
    format!("ctl-{token}")
}

pub fn service_config(dir: &Path, token: &str, extra: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let token_file = dir.join("token");
    std::fs::write(&token_file, format!("{token}\n")).unwrap();
    std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let control_file = dir.join("control-token");
    std::fs::write(&control_file, format!("{}\n", control_token_of(token))).unwrap();
    std::fs::set_permissions(&control_file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let cfg = dir.join("config.toml");
    let base = format!(
        "[agent]\nstate_dir = \"{}\"\n[http]\nlisten = \"127.0.0.1:0\"\ntoken_file = \"{}\"\ncontrol_token_file = \"{}\"\n",
        dir.join("state").display(),
        token_file.display(),
        control_file.display()
    );
    // No vsock listener unless the test asks for one: tests run side by side on a machine that
    // may have a vsock device, and the port is one for the whole machine.
    let vsock = if extra.contains("[vsock]") { "" } else { "\n[vsock]\nenabled = false\n" };
    std::fs::write(&cfg, base + extra + vsock).unwrap();
    cfg
}

/// One systemd unit as the stand-in reports it: (name, LoadState, ActiveState, SubState, UnitFileState).
pub type Unit = (&'static str, &'static str, &'static str, &'static str, &'static str);

pub const HEALTHY_UNITS: &[Unit] = &[
    ("nvidia-persistenced.service", "loaded", "active", "running", "enabled"),
    ("nvidia-fabricmanager.service", "loaded", "active", "running", "enabled"),
];

/// A private `dbus-daemon` with `org.freedesktop.systemd1` answered by this process. Killed on drop.
pub struct PrivateBus {
    pub address: String,
    daemon: Child,
    _dir: tempfile::TempDir,
    _service: zbus::blocking::Connection,
}

impl Drop for PrivateBus {
    fn drop(&mut self) {
        let _ = self.daemon.kill();
        let _ = self.daemon.wait();
    }
}

struct Manager {
    known: Vec<String>,
}

#[zbus::interface(name = "org.freedesktop.systemd1.Manager")]
impl Manager {
    /// Like systemd: any name gets an object; one it does not know has LoadState not-found.
    fn load_unit(&self, name: &str) -> zbus::fdo::Result<OwnedObjectPath> {
        let name = if self.known.iter().any(|k| k == name) { name } else { "unknown.service" };
        OwnedObjectPath::try_from(unit_path(name)).map_err(|e| zbus::fdo::Error::Failed(e.to_string()))
    }
}

struct UnitObject {
    load: String,
    active: String,
    sub: String,
    file: String,
}

#[zbus::interface(name = "org.freedesktop.systemd1.Unit")]
impl UnitObject {
    #[zbus(property)]
    fn load_state(&self) -> String {
        self.load.clone()
    }
    #[zbus(property)]
    fn active_state(&self) -> String {
        self.active.clone()
    }
    #[zbus(property)]
    fn sub_state(&self) -> String {
        self.sub.clone()
    }
    #[zbus(property)]
    fn unit_file_state(&self) -> String {
        self.file.clone()
    }
}

/// systemd's object path escaping: every byte outside [A-Za-z0-9] becomes `_xx`.
fn unit_path(name: &str) -> String {
    let escaped: String = name
        .bytes()
        .map(|b| if b.is_ascii_alphanumeric() { (b as char).to_string() } else { format!("_{b:02x}") })
        .collect();
    format!("/org/freedesktop/systemd1/unit/{escaped}")
}

/// A `dbus-daemon` listening on `socket` that lets anyone send, receive and own any name; its
/// config file lies beside the socket. Returns the daemon and the address it printed.
pub fn dbus_daemon(socket: &Path) -> (Child, String) {
    let config = socket.with_extension("conf");
    std::fs::write(
        &config,
        format!(
            r#"<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN" "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>custom</type>
  <listen>unix:path={}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow send_destination="*"/>
    <allow receive_sender="*"/>
    <allow own="*"/>
  </policy>
</busconfig>
"#,
            socket.display()
        ),
    )
    .unwrap();
    let mut daemon = Command::new("dbus-daemon")
        .arg(format!("--config-file={}", config.display()))
        .args(["--nofork", "--print-address=1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null()) // it complains about fd limits it may not raise in a container
        .spawn()
        .expect("dbus-daemon (PrivateBus::start checks that it is there)");
    let mut line = String::new();
    BufReader::new(daemon.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let address = line.trim().to_string();
    assert!(address.starts_with("unix:"), "dbus-daemon printed {address:?}");
    (daemon, address)
}

impl PrivateBus {
    /// The bus, or a skip when `dbus-daemon` is not installed.
    #[track_caller]
    pub fn start(units: &[Unit]) -> Option<PrivateBus> {
        if !needs(&[("dbus-daemon", "dbus-daemon")]) {
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let (daemon, address) = dbus_daemon(&dir.path().join("bus"));
        let mut builder = zbus::blocking::connection::Builder::address(address.as_str())
            .unwrap()
            .name("org.freedesktop.systemd1")
            .unwrap()
            .serve_at("/org/freedesktop/systemd1", Manager { known: units.iter().map(|u| u.0.to_string()).collect() })
            .unwrap()
            .serve_at(
                unit_path("unknown.service"),
                UnitObject {
                    load: "not-found".into(),
                    active: "inactive".into(),
                    sub: "dead".into(),
                    file: String::new(),
                },
            )
            .unwrap();
        for (name, load, active, sub, file) in units {
            builder = builder
                .serve_at(
                    unit_path(name),
                    UnitObject {
                        load: load.to_string(),
                        active: active.to_string(),
                        sub: sub.to_string(),
                        file: file.to_string(),
                    },
                )
                .unwrap();
        }
        let service = builder.build().expect("serve the systemd stand-in on the private bus");
        Some(PrivateBus { address, daemon, _dir: dir, _service: service })
    }
}

/// A copy of the fixture sysroot `name` at `dir/guest`, for a test that writes into it (its
/// kernel log, its boot id); its path.
pub fn copy_sysroot(name: &str, dir: &Path) -> PathBuf {
    let root = dir.join("guest");
    let copied = Command::new("cp")
        .arg("-a")
        .arg(repo().join("tests/fixtures/sysroots").join(name))
        .arg(&root)
        .status()
        .unwrap();
    assert!(copied.success(), "cp -a {name}");
    root
}

/// `phq-agent serve` over the healthy 8-GPU fixture, the fake NVML with `scenario` and `bus`.
pub fn serve_command(cfg: &Path, scenario: &Path, bus: &PrivateBus) -> Command {
    serve_command_on(&repo().join("tests/fixtures/sysroots/hgx-8gpu-healthy"), cfg, scenario, bus)
}

/// `phq-agent serve` over the sysroot `root`, the fake NVML with `scenario` and `bus`.
pub fn serve_command_on(root: &Path, cfg: &Path, scenario: &Path, bus: &PrivateBus) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_phq-agent"));
    c.args(["serve", "--config"])
        .arg(cfg)
        .arg("--sysroot")
        .arg(root)
        .arg("--nvml-lib")
        .arg(fake_nvml())
        .env("PHQ_FAKE_NVML_SCENARIO", scenario)
        // virt-handler's CA server is asked only on KubeVirt's firmware (`serve::kubevirt_ca`):
        // never the test machine's host. No stand-in is named here, so none is assumed.
        .env_remove("PHQ_KUBEVIRT_CA_SERVER")
        .env("DBUS_SYSTEM_BUS_ADDRESS", &bus.address)
        .env_remove("NOTIFY_SOCKET")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    c
}

/// `phq-agent doctor --json` over a fixture sysroot, the fake NVML with `scenario`, and `bus`.
pub fn doctor(
    sysroot: &str,
    scenario: &str,
    nvml_lib: Option<&Path>,
    bus: Option<&str>,
    extra: &[&str],
) -> (i32, Value, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_phq-agent"));
    cmd.args(["doctor", "--json", "--sysroot"])
        .arg(repo().join("tests/fixtures/sysroots").join(sysroot))
        .arg("--config")
        .arg(repo().join("tests/fixtures/config/empty/config.toml"))
        .arg("--nvml-lib")
        .arg(nvml_lib.unwrap_or_else(|| fake_nvml()))
        .args(extra)
        .env("PHQ_FAKE_NVML_SCENARIO", repo().join("examples/scenarios").join(format!("{scenario}.json")))
        .env_remove("NO_COLOR");
    match bus {
        Some(b) => cmd.env("DBUS_SYSTEM_BUS_ADDRESS", b),
        None => cmd.env_remove("DBUS_SYSTEM_BUS_ADDRESS"),
    };
    let out: Output = cmd.output().expect("run phq-agent");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!stderr.contains("panicked"), "{scenario}: {stderr}");
    let report: Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{scenario}: not JSON ({e}): {stderr}"));
    validate(&report);
    (out.status.code().unwrap_or(-1), report, stderr)
}

pub fn validate(report: &Value) {
    let schema: Value = serde_json::from_str(include_str!("../../schema/phq.status.v1.json")).unwrap();
    let validator = jsonschema::validator_for(&schema).unwrap();
    let errors: Vec<String> =
        validator.iter_errors(report).map(|e| format!("{} at {}", e, e.instance_path())).collect();
    assert!(errors.is_empty(), "report does not match schema/phq.status.v1.json: {errors:#?}");
}

pub fn findings<'a>(r: &'a Value, id: &str) -> Vec<&'a Value> {
    r["findings"].as_array().unwrap().iter().filter(|f| f["id"] == id).collect()
}

/// (id, gpu, severity) of every warning and failure, sorted.
pub fn bad(r: &Value) -> Vec<(String, String, String)> {
    let mut v: Vec<_> = r["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["severity"] == "fail" || f["severity"] == "warn")
        .map(|f| {
            (
                f["id"].as_str().unwrap().to_string(),
                f["gpu"].as_str().unwrap_or("").to_string(),
                f["severity"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    v.sort();
    v
}

pub fn row(id: &str, gpu: &str, sev: &str) -> (String, String, String) {
    (id.into(), gpu.into(), sev.into())
}

/// A YAML text as JSON (through the system Python's yaml module, cloud-init's own); None (a
/// skip) without /usr/bin/python3 and that module.
pub fn yaml(text: &str) -> Option<Value> {
    let python = Path::new("/usr/bin/python3");
    let has_yaml =
        python.is_file() && Command::new(python).args(["-c", "import yaml"]).output().is_ok_and(|o| o.status.success());
    if !has_yaml {
        skip("needs /usr/bin/python3 with its yaml module (apt-get install python3-yaml)");
        return None;
    }
    let mut child = Command::new(python)
        .args(["-c", "import json, sys, yaml; print(json.dumps(yaml.safe_load(sys.stdin)))"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(child.stdin.as_mut().unwrap(), text.as_bytes()).unwrap();
    drop(child.stdin.take());
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    Some(serde_json::from_slice(&out.stdout).unwrap())
}

/// A child process killed and reaped when the test lets go of it, pass or panic.
pub struct Killed(pub Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A raw HTTP/1.1 GET on 127.0.0.1 with a bearer token: (status, body); status 0 when no
/// answer could be read.
pub fn get_with_token(port: u16, path: &str, token: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(10))).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nAuthorization: Bearer {token}\r\n\r\n")
        .unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    let status = out.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, out.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default())
}

/// A GnuPG home with a fresh Ed25519 signing key, standing for a repository's key in a test.
pub struct TestKey {
    pub home: PathBuf,
    /// The key's whole fingerprint, 40 upper-case hex digits.
    pub fpr: String,
}

impl TestKey {
    /// Makes the key in `dir/gnupg` (0700, as gpg wants its home).
    pub fn new(dir: &Path) -> TestKey {
        use std::os::unix::fs::PermissionsExt;
        let home = dir.join("gnupg");
        std::fs::create_dir(&home).unwrap();
        std::fs::set_permissions(&home, std::fs::Permissions::from_mode(0o700)).unwrap();
        let mut key = TestKey { home, fpr: String::new() };
        key.gpg(&[
            "--passphrase",
            "",
            "--quick-gen-key",
            "phq-agent test repository <repo@phq.invalid>",
            "ed25519",
            "sign",
            "never",
        ]);
        key.fpr = key
            .gpg(&["--with-colons", "--list-secret-keys"])
            .lines()
            .find_map(|l| l.strip_prefix("fpr:").map(|r| r.trim_matches(':').to_string()))
            .unwrap();
        key
    }

    /// gpg in batch mode in this home: its stdout, or a failed test with its stderr.
    pub fn gpg(&self, args: &[&str]) -> String {
        let out = Command::new("gpg").arg("--batch").args(args).env("GNUPGHOME", &self.home).output().unwrap();
        assert!(out.status.success(), "gpg {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).to_string()
    }
}
