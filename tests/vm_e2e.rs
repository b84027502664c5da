//! The slowest tier: a Debian 12 VM booted under qemu (TCG) from a debootstrapped root with
//! Debian's kernel and cloud-init, seeded (NoCloud) with the repository's own
//! `cloud-init/debian-12.yaml`. Everything the guest fetches — the agent's .deb, the stand-in
//! NVIDIA repository of the installer test, the platform it pushes to — is served by this test
//! on the host's 127.0.0.1. The guest's user network is restricted (`restrict=on`: no route to
//! the host or beyond); its one way out is a `guestfwd` from 10.0.2.100:8080 to that server
//! (through socat); the guest's port 9440 is forwarded to 127.0.0.1, where it must answer
//! nothing (TCP is off, below). The guest's apt knows only the stand-in repository. Nothing leaves the machine.
//!
//! It shows the whole path: first boot, cloud-init installs the package and starts the service,
//! `phq-agent install` runs and asks for a reboot, cloud-init reboots, the install unit resumes
//! and verifies, the service answers, and reports — the `install` event included — arrive at
//! the platform double. The timeline is printed at the end.
//!
//! The platform's channel (docs/vsock.md) on a real virtio-vsock device: rust-vmm's
//! `vhost-device-vsock` backs QEMU's `vhost-user-vsock-pci` (guest memory a shared memfd), and
//! the host reaches a guest port through its Unix socket (`CONNECT <port>\n`, answered
//! `OK <port>\n`, then the stream), as virt-handler reaches it through AF_VSOCK. The user-data
//! carries the test's CA as KubeVirt's bundle; the image turns the TCP listener off
//! (`http.enabled = false`) and keeps `phq-agent.socket` on the guest's loopback. From the host:
//! a TLS 1.3 client with a certificate from that CA (virt-handler's part) gets `/healthz`,
//! `/v1/status` and `/metrics`; without a certificate, or with another CA's, the handshake is
//! refused; and the forwarded TCP port never answers.
//!
//! 2½ minutes on a 2-core machine (4½ building the guest root): it runs in CI (CI=true) or with PHQ_VM_E2E=1, and
//! needs root, debootstrap, qemu-system-x86_64, cloud-localds, vhost-device-vsock
//! (scripts/test installs it with scripts/cargo-install-tool) and the .deb from
//! scripts/build-packages.sh.

mod common;

use common::debian::*;
use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const HTTP_TOKEN: &str = "0123456789abcdef0123456789abcdef";

struct Timeline {
    t0: Instant,
    events: Vec<(f64, String)>,
}

impl Timeline {
    fn mark(&mut self, what: &str) {
        let t = self.t0.elapsed().as_secs_f64();
        eprintln!("[{t:7.1} s] {what}");
        self.events.push((t, what.to_string()));
    }
}

/// The status line and body of `/healthz`: 200 ok/degraded, 503 unhealthy (this VM has no GPU).
fn healthz(port: u16) -> Option<String> {
    let mut s = std::net::TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: vm\r\nConnection: close\r\n\r\n").ok()?;
    let mut r = String::new();
    s.read_to_string(&mut r).ok()?;
    let status = r.lines().next()?.to_string();
    let body = r.split("\r\n\r\n").nth(1)?.trim().to_string();
    ["ok", "degraded", "unhealthy"].contains(&body.as_str()).then(|| format!("{status} {body}"))
}

#[test]
fn a_vm_boots_through_cloud_init_into_a_reporting_agent() {
    if !common::in_ci() && std::env::var_os("PHQ_VM_E2E").is_none() {
        common::skip("the VM test takes minutes; it runs in CI or with PHQ_VM_E2E=1");
        return;
    }
    let tools = [
        "debootstrap",
        "qemu-system-x86_64",
        "mkfs.ext4",
        "cloud-localds",
        "dpkg-deb",
        "apt-ftparchive",
        "gpg",
        "socat",
        "vhost-device-vsock",
    ];
    if !runnable("the VM test", &tools) {
        return;
    }
    let deb = std::fs::read_dir(target_dir().join("packages"))
        .ok()
        .and_then(|d| d.flatten().map(|e| e.path()).find(|p| p.extension().is_some_and(|e| e == "deb")))
        .expect("the .deb (scripts/build-packages.sh; .ci/run builds it)");
    let mut tl = Timeline { t0: Instant::now(), events: Vec::new() };
    let pki = vsock::pki();

    let base = debootstrap_cached("bookworm-guest");
    tl.mark("guest root ready (debootstrap, cached under target/phq-debian)");
    let kernel = std::fs::read_dir(base.join("lib/modules")).unwrap().flatten().next().unwrap().file_name();
    let kernel = kernel.to_str().unwrap().to_string();

    let work = tempfile::Builder::new().prefix("phq-vm-").tempdir_in(target_dir()).unwrap();
    let w = work.path();
    let www = w.join("www");
    let fpr = build_repo(&www.join("repo"), &kernel);
    std::fs::copy(&deb, www.join("phq-agent.deb")).unwrap();
    let server = serve(www.clone());
    let host = "http://10.0.2.100:8080".to_string();

    // The repository's own user-data, its variables filled in as the operator guide says.
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let template = std::fs::read_to_string(repo.join("cloud-init/debian-12.yaml")).unwrap();
    // The package's SHA-256, as the operator takes it from SHA256SUMS: the guest refuses any other.
    let sum = Command::new("sha256sum").arg(&deb).output().unwrap();
    let sha256 = String::from_utf8_lossy(&sum.stdout).split(' ').next().unwrap_or_default().to_string();
    assert_eq!(sha256.len(), 64, "sha256sum {}", deb.display());
    let vars = [
        ("PHQ_PACKAGE_URL", format!("{host}/phq-agent.deb")),
        ("PHQ_PACKAGE_SHA256", sha256),
        ("PHQ_HTTP_TOKEN", HTTP_TOKEN.to_string()),
        ("PHQ_PLATFORM_URL", host.clone()),
        ("PHQ_PLATFORM_TOKEN", "platform-token-for-the-vm-test".to_string()),
        ("PHQ_CUDA", "12.9".to_string()),
        ("PHQ_DRIVER_BRANCH", "580".to_string()),
        ("PHQ_REPO_URL", format!("{host}/repo")),
        ("PHQ_REPO_KEY_FINGERPRINT", fpr.clone()),
        ("PHQ_VSOCK_PORT", VSOCK_PORT.to_string()),
        ("PHQ_VSOCK_CA_B64", base64::Engine::encode(&base64::engine::general_purpose::STANDARD, &pki.ca)),
    ];
    // Through cloud-init/render, as the operator guide says: every value checked first.
    let rendered = Command::new(repo.join("cloud-init/render"))
        .arg(repo.join("cloud-init/debian-12.yaml"))
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .envs(vars.iter().map(|(k, v)| (*k, v.as_str())))
        .output()
        .unwrap();
    assert!(rendered.status.success(), "render: {}", String::from_utf8_lossy(&rendered.stderr));
    let user_data = String::from_utf8(rendered.stdout).unwrap();
    assert_eq!(user_data, vars.iter().fold(template, |t, (k, v)| t.replace(&format!("${{{k}}}"), v)));
    assert!(!user_data.contains("${PHQ_"), "{user_data}");
    std::fs::write(w.join("user-data"), &user_data).unwrap();
    std::fs::write(w.join("meta-data"), "instance-id: phq-vm-e2e\nlocal-hostname: gpu-vm\n").unwrap();
    sh(
        "cloud-localds",
        &[
            w.join("seed.img").to_str().unwrap(),
            w.join("user-data").to_str().unwrap(),
            w.join("meta-data").to_str().unwrap(),
        ],
    );

    // The disk: the root as it is, plus what a cloud image has and debootstrap does not.
    let root = w.join("root");
    sh("cp", &["-a", base.to_str().unwrap(), root.to_str().unwrap()]);
    std::fs::write(root.join("etc/fstab"), "/dev/vda / ext4 defaults,errors=remount-ro 0 1\n").unwrap();
    std::fs::write(root.join("etc/hostname"), "gpu-vm\n").unwrap();
    std::fs::write(root.join("etc/cloud/cloud.cfg.d/99-phq-test.cfg"), "datasource_list: [NoCloud, None]\n").unwrap();
    // The stand-in mirror is plain http on the host's side of the VM's network: allowed
    // explicitly, as an image with a preset config would (apt still checks the signed index).
    std::fs::create_dir_all(root.join("etc/phq-agent/config.d")).unwrap();
    // The platform alone reaches the agent: no TCP listener, and the port systemd binds for it
    // kept on the guest's loopback (docs/vsock.md), so the forwarded port finds nothing.
    std::fs::write(
        root.join("etc/phq-agent/config.d/10-image.toml"),
        "[install]\nallow_plain_http = true\n[http]\nenabled = false\n",
    )
    .unwrap();
    std::fs::create_dir_all(root.join("etc/systemd/system/phq-agent.socket.d")).unwrap();
    std::fs::write(
        root.join("etc/systemd/system/phq-agent.socket.d/loopback.conf"),
        "[Socket]\nListenStream=\nListenStream=127.0.0.1:9440\n",
    )
    .unwrap();
    // A user's program at the first moment one can run (after basic.target, so after
    // sockets.target) tries to take the agent's vsock port, as `nobody`, with Python's AF_VSOCK
    // (python3 is in the image for cloud-init). It says on the console what systemd reports for
    // phq-agent-vsock.socket and what its bind got. Once the package is installed: from boot 2 on.
    std::fs::write(
        root.join("usr/local/bin/phq-squat"),
        format!(
            "import socket, subprocess\n\
             unit = subprocess.run(['systemctl', 'show', '-p', 'ActiveState', '-p', 'Listen', \
             'phq-agent-vsock.socket'], capture_output=True, text=True).stdout.split()\n\
             s = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)\n\
             try:\n    s.bind((socket.VMADDR_CID_ANY, {VSOCK_PORT}))\n    s.listen()\n    got = 'bound'\n\
             except OSError as e:\n    got = 'refused: ' + str(e)\n\
             print('phq-squat:', ' '.join(unit), '; bind of vsock port {VSOCK_PORT} as nobody:', got, flush=True)\n"
        ),
    )
    .unwrap();
    std::fs::write(
        root.join("etc/systemd/system/phq-squat.service"),
        "[Unit]\nDescription=an unprivileged user tries to take the agent's vsock port\n\
         ConditionPathExists=/lib/systemd/system/phq-agent-vsock.socket\n\
         [Service]\nType=oneshot\nUser=nobody\nExecStart=/usr/bin/python3 /usr/local/bin/phq-squat\n\
         StandardOutput=journal+console\n[Install]\nWantedBy=multi-user.target\n",
    )
    .unwrap();
    std::os::unix::fs::symlink(
        "/etc/systemd/system/phq-squat.service",
        root.join("etc/systemd/system/multi-user.target.wants/phq-squat.service"),
    )
    .unwrap();
    // A persistent journal, read from the disk image afterwards.
    std::fs::create_dir_all(root.join("var/log/journal")).unwrap();
    // The guest has no way to Debian's mirrors: its apt sources are the stand-ins, Debian's
    // archive with `main` alone (the installer adds contrib for the driver's `nvidia-support`).
    debian_archive_source(&root, &www.join("repo"), &format!("{host}/repo"));
    // An initramfs of the modules this machine uses, as cloud images build it: the full set
    // takes minutes to compress under TCG.
    std::fs::write(root.join("etc/initramfs-tools/conf.d/phq-vm-test.conf"), "MODULES=dep\n").unwrap();
    sh(
        "mkfs.ext4",
        &["-q", "-F", "-L", "root", "-d", root.to_str().unwrap(), w.join("disk.img").to_str().unwrap(), "4G"],
    );
    tl.mark("disk and NoCloud seed made from cloud-init/debian-12.yaml");

    // The guest's virtio-vsock device, served by vhost-device-vsock over vhost-user.
    let (vhost_socket, uds) = (w.join("vhost-vsock.sock"), w.join("vm.vsock"));
    let mut vhost = Command::new("vhost-device-vsock")
        .arg("--vm")
        .arg(format!("guest-cid={GUEST_CID},socket={},uds-path={}", vhost_socket.display(), uds.display()))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let waited = Instant::now();
    while !vhost_socket.exists() {
        assert!(waited.elapsed() < Duration::from_secs(30), "vhost-device-vsock made no socket");
        assert!(vhost.try_wait().unwrap().is_none(), "vhost-device-vsock exited");
        std::thread::sleep(Duration::from_millis(50));
    }

    // virt-handler's CA server, as the guest reaches it: CID 2, port 1, which vhost-device-vsock
    // connects to the Unix socket `<uds-path>_1` (its README: guest-initiated connections to
    // host port P go to `<uds-path>_P`). A stand-in generated from KubeVirt's system.proto,
    // served by grpcio; it serves cloud-init's bundle until the test rotates the CA.
    let ca_served = w.join("ca-served.pem");
    std::fs::write(&ca_served, &pki.ca).unwrap();
    let ca_socket = PathBuf::from(format!("{}_1", uds.display()));
    let mut ca_server = Command::new("/usr/bin/python3")
        .arg(common::repo().join("tests/fixtures/kubevirt/ca-server.py"))
        .arg(&ca_socket)
        .arg(&ca_served)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let waited = Instant::now();
    while !ca_socket.exists() {
        assert!(waited.elapsed() < Duration::from_secs(30), "the CA server stand-in made no socket");
        std::thread::sleep(Duration::from_millis(50));
    }

    let console = w.join("console.log");
    let mut qemu = Command::new("qemu-system-x86_64")
        .args([
            "-accel",
            "tcg",
            "-cpu",
            "max",
            "-m",
            "2048",
            "-smp",
            "2",
            "-nographic",
            "-nodefaults",
            "-no-user-config",
            // The firmware KubeVirt's virt-launcher gives a VM (its SMBIOS system: manufacturer
            // and family "KubeVirt"), which the agent reads before it asks CID 2 for the CA.
            "-smbios",
            "type=1,manufacturer=KubeVirt,family=KubeVirt,product=None",
        ])
        .arg("-serial")
        .arg(format!("file:{}", console.display()))
        .arg("-kernel")
        .arg(root.join(format!("boot/vmlinuz-{kernel}")))
        .arg("-initrd")
        .arg(root.join(format!("boot/initrd.img-{kernel}")))
        .args(["-append", "root=/dev/vda rw console=ttyS0 net.ifnames=0"])
        .arg("-drive")
        .arg(format!("file={},if=virtio,format=raw", w.join("disk.img").display()))
        .arg("-drive")
        .arg(format!("file={},if=virtio,format=raw", w.join("seed.img").display()))
        .args([
            "-netdev",
            &format!(
                "user,id=n0,restrict=on,hostfwd=tcp:127.0.0.1:0-:9440,guestfwd=tcp:10.0.2.100:8080-cmd:socat - TCP:127.0.0.1:{}",
                server.port
            ),
        ])
        .args(["-device", "virtio-net-pci,netdev=n0", "-device", "virtio-rng-pci"])
        // vhost-user maps the guest's memory: a shared memfd (vhost-device-vsock's README).
        .args(["-object", "memory-backend-memfd,id=mem0,size=2048M,share=on", "-machine", "memory-backend=mem0"])
        .arg("-chardev")
        .arg(format!("socket,id=vsock0,path={}", vhost_socket.display()))
        .args(["-device", "vhost-user-vsock-pci,chardev=vsock0"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The forwarded port is the one the kernel gave qemu's listener (hostfwd port 0).
    let fwd = common::listening_port(&mut qemu).expect("qemu listens for the forwarded /healthz port");
    tl.mark(&format!(
        "qemu started (TCG, 2 vCPUs, 2 GiB, virtio-vsock CID {GUEST_CID}), port 9440 forwarded from 127.0.0.1:{fwd}"
    ));
    let platform = vsock::client(Some(&pki.platform));

    // Follow the console and the servers until the install event arrives.
    let deadline = Instant::now() + Duration::from_secs(30 * 60);
    let mut seen: std::collections::HashSet<String> = std::collections::HashSet::new();
    let mut boots = 0;
    let mut done_event = None;
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_secs(2));
        if let Ok(Some(status)) = qemu.try_wait() {
            let mut err = String::new();
            let _ = qemu.stderr.take().unwrap().read_to_string(&mut err);
            panic!("qemu exited ({status}): {err}");
        }
        let text = String::from_utf8_lossy(&std::fs::read(&console).unwrap_or_default()).into_owned();
        let n = text.matches("Linux version ").count();
        while boots < n {
            boots += 1;
            tl.mark(&format!("boot {boots}: kernel started"));
        }
        for (needle, what) in [
            ("Cloud-init v.", "cloud-init started"),
            ("Reached target", "systemd reached its first targets"),
            ("finished at", "cloud-init finished (first boot)"),
            ("reboot: Restarting system", "the VM rebooted (cloud-init's power_state, the installer asked)"),
        ] {
            if text.contains(needle) && seen.insert(needle.to_string()) {
                tl.mark(what);
            }
        }
        // TCP is off: the forwarded port must never answer.
        if let Some(answer) = healthz(fwd) {
            if seen.insert("tcp-answered".into()) {
                tl.mark(&format!("/healthz answered over TCP, which is off: {answer}"));
            }
        }
        if !seen.contains("healthz") {
            if let Ok(answer) = vsock::get(&uds, &platform, "/healthz") {
                seen.insert("healthz".into());
                tl.mark(&format!(
                    "/healthz answered over vsock with the platform's certificate: {}",
                    vsock::status_line(&answer)
                ));
            }
        }
        let posts = server.posts.lock().unwrap().clone();
        let reports: Vec<serde_json::Value> = posts
            .iter()
            .filter(|p| p.path.starts_with("/v1/agents/"))
            .filter_map(|p| serde_json::from_slice(&p.body).ok())
            .collect();
        if !reports.is_empty() && seen.insert("first-report".into()) {
            let auth = posts[0].headers.iter().find(|(k, _)| k == "authorization").map(|(_, v)| v.clone());
            assert_eq!(auth.as_deref(), Some("Bearer platform-token-for-the-vm-test"));
            tl.mark(&format!("first report at the platform double (health {})", reports[0]["health"]));
        }
        for r in &reports {
            let status = r["install"]["status"].as_str().unwrap_or("");
            if !status.is_empty() && seen.insert(format!("install-{status}")) {
                tl.mark(&format!("a report says install.status = {status}"));
            }
            if r["event"]["kind"] == "install" && seen.insert(format!("event-{}", r["seq"])) {
                tl.mark(&format!("install event at the platform double: {}", r["event"]));
                if r["event"]["status"] == "done" {
                    done_event = Some(r.clone());
                }
            }
        }
        if done_event.is_some() && seen.contains("healthz") {
            break;
        }
    }
    // The platform's channel, checked while the guest still runs (after the install is done).
    let mut over_vsock = Vec::new();
    let mut ca_status: Option<serde_json::Value> = None;
    let mut platform_page: Option<Result<String, String>> = None;
    if seen.contains("healthz") {
        for path in ["/healthz", "/v1/status", "/metrics"] {
            over_vsock.push((path, vsock::get(&uds, &platform, path)));
        }
        let stranger = vsock::client(Some(&pki.stranger));
        over_vsock.push(("/healthz without a certificate", vsock::get(&uds, &vsock::client(None), "/healthz")));
        over_vsock.push(("/healthz with another CA's certificate", vsock::get(&uds, &stranger, "/healthz")));
        // KubeVirt's CA rotates mid-run: virt-handler serves the new bundle and its client
        // certificate comes from the new CA. The agent's next handshake asks CID 2 port 1 and
        // lets it in, without a restart; virt-handler's certificate from the retired CA is
        // refused. The report says where the bundle came from.
        std::fs::write(&ca_served, &pki.new_ca).unwrap();
        // The stranger's refused handshake above asked virt-handler once; the agent asks at
        // most once per `client_ca::RETRY_AFTER`, so a stranger cannot make it call in a loop.
        std::thread::sleep(phq_agent::serve::client_ca::RETRY_AFTER + Duration::from_secs(1));
        let rotated = vsock::client(Some(&pki.new_platform));
        over_vsock.push(("/v1/status with the rotated CA's certificate", vsock::get(&uds, &rotated, "/v1/status")));
        over_vsock.push(("/healthz with the retired CA's certificate", vsock::get(&uds, &platform, "/healthz")));
        // The report is the last snapshot's (taken every 30 s): the next one says where the
        // bundle in force came from.
        let asked = Instant::now();
        let source = loop {
            let body = vsock::get(&uds, &rotated, "/v1/status")
                .ok()
                .and_then(|a| serde_json::from_str::<serde_json::Value>(a.split("\r\n\r\n").nth(1)?).ok());
            let source = body.map(|b| b["agent"]["vsock_ca"].clone()).unwrap_or_default();
            if source["source"] == "virt_handler" || asked.elapsed() > Duration::from_secs(90) {
                break source;
            }
            std::thread::sleep(Duration::from_secs(2));
        };
        tl.mark(&format!("the report's vsock_ca after the rotation: {source}"));
        ca_status = Some(source);
        // The platform's poller reaches this VM's agent as it would in a cluster: through the
        // stand-ins for kube-apiserver and virt-api, whose virt-handler leg is this VM's
        // virtio-vsock (tests/fixtures/kubevirt/api-standin.py), with KubeVirt's rotated
        // client certificate.
        let page = platform::poll_through_vsock(w, &uds, &pki.new_platform);
        tl.mark(&format!(
            "phq-platform through the vsock subresource: {}",
            page.as_ref().map(|p| platform::line(p, "phq_poll_success")).unwrap_or_else(|e| e.clone())
        ));
        platform_page = Some(page);
        for (what, got) in &over_vsock {
            let said = match got {
                Ok(a) => vsock::status_line(a).to_string(),
                Err(e) => format!("refused: {e}"),
            };
            tl.mark(&format!("vsock {what}: {said}"));
        }
    }
    let tcp_silent = healthz(fwd).is_none() && !seen.contains("tcp-answered");
    let _ = qemu.kill();
    let _ = qemu.wait();
    let _ = vhost.kill();
    let _ = vhost.wait();
    let _ = ca_server.kill();
    let _ = ca_server.wait();
    let console_text = String::from_utf8_lossy(&std::fs::read(&console).unwrap_or_default()).into_owned();
    let keep = target_dir().join("phq-vm-e2e-console.log");
    let _ = std::fs::write(&keep, &console_text);
    let timeline: String = tl.events.iter().map(|(t, what)| format!("  {t:7.1} s  {what}\n")).collect();
    eprintln!("\ntimeline:\n{timeline}");
    // Kept beside the console log: cargo test shows a passing test's output to no one.
    let _ = std::fs::write(target_dir().join("phq-vm-e2e-timeline.txt"), &timeline);
    eprintln!("(console log kept at {})", keep.display());
    let journal = guest_journal(&w.join("disk.img"), &w.join("journal"));
    let _ = std::fs::write(target_dir().join("phq-vm-e2e-journal.log"), &journal);
    eprintln!("the guest's journal of the agent's units:\n{}", tail(&journal));
    let event = done_event
        .unwrap_or_else(|| panic!("no install event reached the platform; console tail:\n{}", tail(&console_text)));
    assert_eq!(event["event"]["status"], "done", "{event:#}");
    assert_eq!(event["install"]["reboots"], 1, "{event:#}");
    assert!(boots >= 2, "the VM never rebooted");
    assert!(seen.contains("healthz"), "/healthz never answered over vsock");
    assert!(tcp_silent, "the guest's TCP port answered with http.enabled = false");
    let answer = |i: usize| over_vsock[i].1.as_deref().unwrap_or_else(|e| panic!("{}: {e}", over_vsock[i].0));
    let healthz = answer(0);
    assert!(
        ["HTTP/1.1 200 OK", "HTTP/1.1 503 Service Unavailable"].contains(&vsock::status_line(healthz)),
        "{healthz}"
    );
    let status = answer(1);
    assert_eq!(vsock::status_line(status), "HTTP/1.1 200 OK", "{status}");
    let body: serde_json::Value = serde_json::from_str(status.split("\r\n\r\n").nth(1).unwrap_or("")).unwrap();
    assert_eq!(body["schema"], "phq.status/v1");
    let metrics = answer(2);
    assert!(vsock::status_line(metrics) == "HTTP/1.1 200 OK" && metrics.contains("phq_"), "{metrics}");
    for (what, got) in &over_vsock[3..5] {
        assert!(got.is_err(), "{what} was answered: {got:?}");
    }
    let rotated = answer(5);
    assert_eq!(vsock::status_line(rotated), "HTTP/1.1 200 OK", "{rotated}");
    let ca_status = ca_status.unwrap_or_default();
    assert_eq!(ca_status["source"], "virt_handler", "{ca_status:#}");
    assert!(ca_status["last_fetch"]["error"].is_null(), "{ca_status:#}");
    assert!(over_vsock[6].1.is_err(), "the retired CA's certificate was answered: {:?}", over_vsock[6].1);
    let page =
        platform_page.expect("the poller ran").unwrap_or_else(|e| panic!("phq-platform through the VM's vsock: {e}"));
    let polled = platform::line(&page, "phq_poll_success");
    assert!(polled.contains("transport=\"vsock\"") && polled.ends_with(" 1"), "{page}");
    assert!(page.lines().any(|l| l.starts_with("phq_guest_verdict{") && l.contains("vmi=\"gpu-vm-e2e\"")), "{page}");
    // The port was PID 1's from sockets.target on, before any user could run a program, and
    // a user's bind was refused; the agent served the socket it was passed (the answers above:
    // it could not have bound the port itself while systemd held it).
    let squat = console_text.lines().rfind(|l| l.contains("phq-squat: "));
    let squat =
        squat.unwrap_or_else(|| panic!("the squat check said nothing on the console:\n{}", tail(&console_text)));
    assert!(
        squat.contains("ActiveState=active")
            && squat.contains("Listen=vsock:")
            && squat.contains(&format!(":{VSOCK_PORT}")),
        "{squat}"
    );
    assert!(squat.contains("as nobody: refused: [Errno 98] Address already in use"), "{squat}");
}

/// The vsock port the user-data gives the agent, and the guest's CID.
const VSOCK_PORT: u32 = 9440;
const GUEST_CID: u32 = 3;

/// The host's side of the guest's vsock, as virt-handler is the platform's: through
/// vhost-device-vsock's Unix socket instead of AF_VSOCK, then TLS 1.3 with a client certificate.
mod vsock {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
    use std::io::{Read, Write};
    use std::path::Path;
    use std::sync::Arc;
    use std::time::Duration;
    use tokio_rustls::rustls;
    use tokio_rustls::rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};

    pub struct Pki {
        /// KubeVirt's bundle, as cloud-init writes it.
        pub ca: String,
        /// virt-handler's client certificate and key.
        pub platform: (String, String),
        /// A certificate and key from another CA.
        pub stranger: (String, String),
        /// The CA KubeVirt rotates to during the run, and virt-handler's certificate from it.
        pub new_ca: String,
        pub new_platform: (String, String),
    }

    pub fn pki() -> Pki {
        let ca_of = |name: &str| {
            let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
            p.distinguished_name.push(DnType::CommonName, name);
            p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            CertifiedIssuer::self_signed(p, KeyPair::generate().unwrap()).unwrap()
        };
        // As KubeVirt issues virt-handler's vsock client certificate (`secrets.go`,
        // `triple.NewClientKeyPair`): named kubevirt.io:system:client:vsock, clientAuth.
        let leaf = |issuer: &CertifiedIssuer<'_, KeyPair>| {
            let key = KeyPair::generate().unwrap();
            let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
            p.distinguished_name.push(DnType::CommonName, "kubevirt.io:system:client:vsock");
            p.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
            let cert = p.signed_by(&key, issuer).unwrap();
            (cert.pem(), key.serialize_pem())
        };
        let (ca, other, next) = (ca_of("kubevirt.io CA (test)"), ca_of("another CA"), ca_of("kubevirt.io CA, rotated"));
        Pki { ca: ca.pem(), platform: leaf(&ca), stranger: leaf(&other), new_ca: next.pem(), new_platform: leaf(&next) }
    }

    /// virt-handler trusts any server certificate (`InsecureSkipVerify`), but still checks the
    /// handshake's signature with it, as Go's TLS does.
    #[derive(Debug)]
    struct AnyServer(Arc<rustls::crypto::CryptoProvider>);

    impl ServerCertVerifier for AnyServer {
        fn verify_server_cert(
            &self,
            _: &CertificateDer<'_>,
            _: &[CertificateDer<'_>],
            _: &ServerName<'_>,
            _: &[u8],
            _: UnixTime,
        ) -> Result<ServerCertVerified, rustls::Error> {
            Ok(ServerCertVerified::assertion())
        }
        fn verify_tls12_signature(
            &self,
            _: &[u8],
            _: &CertificateDer<'_>,
            _: &rustls::DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            Err(rustls::Error::General("TLS 1.2 is not what virt-handler speaks".into()))
        }
        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &rustls::DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0.signature_verification_algorithms)
        }
        fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
            self.0.signature_verification_algorithms.supported_schemes()
        }
    }

    /// A TLS 1.3 client presenting `identity` when given.
    pub fn client(identity: Option<&(String, String)>) -> Arc<rustls::ClientConfig> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let b = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AnyServer(provider)));
        Arc::new(match identity {
            None => b.with_no_client_auth(),
            Some((c, k)) => b
                .with_client_auth_cert(
                    vec![CertificateDer::from_pem_slice(c.as_bytes()).unwrap()],
                    PrivateKeyDer::from_pem_slice(k.as_bytes()).unwrap(),
                )
                .unwrap(),
        })
    }

    /// `GET path` to the guest's vsock port through vhost-device-vsock's socket `uds`: the whole
    /// answer, or why there is none (no guest listening yet, a refused handshake).
    pub fn get(uds: &Path, config: &Arc<rustls::ClientConfig>, path: &str) -> Result<String, String> {
        let mut s = std::os::unix::net::UnixStream::connect(uds).map_err(|e| format!("{}: {e}", uds.display()))?;
        s.set_read_timeout(Some(Duration::from_secs(20))).map_err(|e| e.to_string())?;
        // vhost-device-vsock's Unix-socket protocol (Firecracker's): `CONNECT <port>\n`, then
        // `OK <host port>\n` once the guest accepted. Read a byte at a time: what follows the
        // line is the guest's stream, for TLS.
        s.write_all(format!("CONNECT {}\n", super::VSOCK_PORT).as_bytes()).map_err(|e| e.to_string())?;
        let mut ok = Vec::new();
        let mut byte = [0u8; 1];
        while ok.last() != Some(&b'\n') && ok.len() < 64 {
            match s.read(&mut byte) {
                Ok(1) => ok.push(byte[0]),
                Ok(_) => break,
                Err(e) => return Err(e.to_string()),
            }
        }
        let ok = String::from_utf8_lossy(&ok);
        if !ok.starts_with("OK ") {
            return Err(format!("no guest listening ({ok:?})"));
        }
        let conn = rustls::ClientConnection::new(config.clone(), ServerName::try_from("phq-agent").unwrap())
            .map_err(|e| e.to_string())?;
        let mut tls = rustls::StreamOwned::new(conn, s);
        let request = format!("GET {path} HTTP/1.1\r\nHost: phq-agent\r\nConnection: close\r\n\r\n");
        tls.write_all(request.as_bytes()).map_err(|e| format!("handshake or request: {e}"))?;
        let mut answer = Vec::new();
        let mut buf = [0u8; 16384];
        loop {
            match tls.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => answer.extend_from_slice(&buf[..n]),
                // The agent closes without close_notify after `Connection: close`: what came is the answer.
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !answer.is_empty() => break,
                Err(e) => return Err(e.to_string()),
            }
        }
        let answer = String::from_utf8_lossy(&answer).into_owned();
        if answer.is_empty() {
            return Err("closed without an answer".into());
        }
        Ok(answer)
    }

    pub fn status_line(answer: &str) -> &str {
        answer.lines().next().unwrap_or("")
    }
}

/// The journal of the agent's units and cloud-init's final stage, read from the disk image.
fn guest_journal(disk: &std::path::Path, out: &std::path::Path) -> String {
    std::fs::create_dir_all(out).unwrap();
    let dump =
        Command::new("debugfs").arg("-R").arg(format!("rdump /var/log/journal {}", out.display())).arg(disk).output();
    if dump.is_err() {
        return "(debugfs is not installed: no journal)".into();
    }
    let out = Command::new("journalctl")
        .arg("-D")
        .arg(out.join("journal"))
        .args([
            "--no-pager",
            "-o",
            "short-monotonic",
            "-u",
            "phq-agent",
            "-u",
            "phq-agent-install",
            "-u",
            "cloud-final",
            "-u",
            "phq-agent-vsock.socket",
            "-u",
            "phq-squat",
        ])
        .output();
    match out {
        Ok(o) => format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)),
        Err(e) => format!("(journalctl: {e})"),
    }
}

fn tail(s: &str) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(60)..].join("\n")
}

/// phq-platform against the running VM, through the stand-in API server (Python, as the other
/// stand-ins) whose virt-handler leg dials the VM's agent on vhost-device-vsock's socket.
mod platform {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
    use std::io::{BufRead, Read, Write};
    use std::path::Path;
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};

    /// The first line of `family` on the page, or "(none)".
    pub fn line(page: &str, family: &str) -> String {
        page.lines().find(|l| l.starts_with(&format!("{family}{{"))).unwrap_or("(none)").to_string()
    }

    struct Killed(std::process::Child);
    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    pub fn poll_through_vsock(w: &Path, uds: &Path, handler: &(String, String)) -> Result<String, String> {
        let dir = w.join("platform");
        let state = dir.join("standin");
        std::fs::create_dir_all(&state).map_err(|e| e.to_string())?;
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.distinguished_name.push(DnType::CommonName, "kube-apiserver CA (test)");
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = CertifiedIssuer::self_signed(p, KeyPair::generate().unwrap()).unwrap();
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(vec!["127.0.0.1".to_string()]).unwrap();
        p.distinguished_name = rcgen::DistinguishedName::new();
        p.distinguished_name.push(DnType::CommonName, "kube-apiserver (test)");
        let api = p.signed_by(&key, &ca).unwrap();
        let write = |name: &str, text: &str| std::fs::write(state.join(name), text).map_err(|e| e.to_string());
        write("tls.pem", &api.pem())?;
        write("tls.key", &key.serialize_pem())?;
        write("handler.pem", &handler.0)?;
        write("handler.key", &handler.1)?;
        write(
            "tokens.json",
            r#"{"sa-token": {"user": "system:serviceaccount:phq-platform:phq-platform", "allow": ["list", "watch", "vsock"]}}"#,
        )?;
        let vmi = serde_json::json!([{"guest": format!("uds:{}", uds.display()), "vmi": {
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"namespace": "team-e2e", "name": "gpu-vm-e2e", "uid": "0b9d1c2e-0000-4000-8000-0000000003e2",
                         "labels": {"kubevirt.io/nodeName": "e2e-node"}},
            "spec": {"domain": {"devices": {"autoattachVSOCK": true,
                     "hostDevices": [{"name": "gpu0", "deviceName": "nvidia.com/GH100_H100_SXM5_80GB"}]}}},
            "status": {"phase": "Running", "nodeName": "e2e-node", "vsockCID": 3}}}]);
        write("vmis.json", &vmi.to_string())?;
        std::fs::write(dir.join("kube-ca.pem"), ca.pem()).map_err(|e| e.to_string())?;
        std::fs::write(dir.join("token"), "sa-token\n").map_err(|e| e.to_string())?;
        let mut standin = Command::new("python3")
            .arg(super::common::repo().join("tests/fixtures/kubevirt/api-standin.py"))
            .arg("--state")
            .arg(&state)
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(dir.join("standin.log")).map_err(|e| e.to_string())?)
            .spawn()
            .map_err(|e| format!("python3: {e}"))?;
        let mut first = String::new();
        std::io::BufReader::new(standin.stdout.take().unwrap()).read_line(&mut first).map_err(|e| e.to_string())?;
        let _standin = Killed(standin);
        let api_port =
            first.trim().strip_prefix("listening ").ok_or(format!("the stand-in said {first:?}"))?.to_string();
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let built = Command::new(cargo)
            .args(["build", "--quiet", "-p", "phq-platform"])
            .current_dir(super::common::repo())
            .status()
            .map_err(|e| e.to_string())?;
        if !built.success() {
            return Err("cargo build -p phq-platform failed".into());
        }
        let cfg = dir.join("platform.toml");
        std::fs::write(
            &cfg,
            format!(
                "node = \"e2e-node\"\nlisten = \"127.0.0.1:0\"\n[poll]\ninterval = \"2s\"\njitter = \"1s\"\ntimeout = \"2s\"\n\
                 [kubernetes]\nenabled = true\napi_server = \"127.0.0.1:{api_port}\"\nca_file = \"{}\"\ntoken_file = \"{}\"\ntransport = \"vsock\"\n",
                dir.join("kube-ca.pem").display(),
                dir.join("token").display()
            ),
        )
        .map_err(|e| e.to_string())?;
        let mut poller = Command::new(target_dir().join("debug/phq-platform"));
        poller.arg("--config").arg(&cfg).stdout(Stdio::null());
        poller.stderr(std::fs::File::create(dir.join("platform.log")).map_err(|e| e.to_string())?);
        let mut child = Killed(poller.spawn().map_err(|e| e.to_string())?);
        let port = super::common::listening_port(&mut child.0).ok_or("the poller exited")?;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let mut page = String::new();
            if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
                let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
                let _ = write!(s, "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
                let _ = s.read_to_string(&mut page);
            }
            if line(&page, "phq_poll_success").ends_with(" 1") {
                return Ok(page);
            }
            if Instant::now() > deadline {
                let log = std::fs::read_to_string(dir.join("platform.log")).unwrap_or_default();
                let standin = std::fs::read_to_string(dir.join("standin.log")).unwrap_or_default();
                return Err(format!("no good poll in 60 s: {}\n{log}\n{standin}", line(&page, "phq_poll_success")));
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    fn target_dir() -> std::path::PathBuf {
        std::env::var("CARGO_TARGET_DIR").map(Into::into).unwrap_or_else(|_| super::common::repo().join("target"))
    }
}
