//! Every shipped user-data file is valid cloud-config (`cloud-init schema -c`), and each does
//! what the operator guide says: config and tokens, the package, the service, the installer,
//! the conditional reboot.

mod common;

use phq_agent::install::journal::{journal_bytes, state_path, State, Status};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The user-data that installs from the platform's signed repositories, and the package manager each uses.
const REPO_FILES: &[(&str, &str)] = &[("apt-repository.yaml", "apt-get"), ("dnf-repository.yaml", "dnf")];

const FILES: &[(&str, &str)] = &[
    ("ubuntu-22.04.yaml", "apt-get"),
    ("ubuntu-24.04.yaml", "apt-get"),
    ("debian-12.yaml", "apt-get"),
    ("rhel-9.yaml", "dnf"),
];

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("cloud-init")
}

#[test]
fn every_user_data_passes_cloud_init_schema() {
    if !common::needs(&[("cloud-init", "cloud-init"), ("envsubst", "gettext-base")]) {
        return;
    }
    let version = Command::new("cloud-init").arg("--version").output().unwrap();
    eprintln!("{}", String::from_utf8_lossy(&version.stdout).trim());
    let tmp = tempfile::tempdir().unwrap();
    for (file, _) in FILES.iter().chain(REPO_FILES) {
        // The file as shipped, and as render fills it in with each set of good values.
        let mut paths = vec![dir().join(file)];
        for (i, vars) in good_values().iter().enumerate() {
            let (code, filled, err) = render(file, vars);
            assert_eq!(code, Some(0), "{file}: {err}");
            paths.push(tmp.path().join(format!("{i}-{file}")));
            std::fs::write(paths.last().unwrap(), filled).unwrap();
        }
        for path in paths {
            let out = Command::new("cloud-init").args(["schema", "-c"]).arg(&path).output().unwrap();
            let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            assert!(out.status.success() && text.contains("Valid cloud-config"), "{}: {text}", path.display());
        }
    }
}

#[test]
fn every_user_data_installs_configures_and_survives_the_reboot() {
    for (file, installer) in FILES.iter().chain(REPO_FILES) {
        let text = std::fs::read_to_string(dir().join(file)).unwrap();
        assert!(text.starts_with("#cloud-config\n"), "{file}");
        for must in [
            "/etc/phq-agent/config.d/50-cloud-init.toml",
            "path: /etc/phq-agent/token\n    permissions: \"0600\"",
            "path: /etc/phq-agent/platform-token\n    permissions: \"0600\"",
            "systemctl enable --now phq-agent.service",
            "phq-agent install --reboot never",
            "power_state:",
            "\"status\": \"reboot-required\"",
            installer,
        ] {
            assert!(text.contains(must), "{file} lacks {must:?}");
        }
        // The reboot's condition greps the installer's real journal, as the installer writes
        // it when a reboot is required (and not when it is done).
        let (pattern, path) = reboot_condition(&text).unwrap_or_else(|| panic!("{file}: no grep condition"));
        let journal_dir = Path::new(phq_agent::install::journal::JOURNAL_DIR);
        assert_eq!(Path::new(&path), state_path(journal_dir), "{file} greps another file than the journal");
        let written = |status| String::from_utf8(journal_bytes(&journal(status)).unwrap()).unwrap();
        assert!(written(Status::RebootRequired).contains(&pattern), "{file}: {pattern:?} is not in the journal");
        assert!(!written(Status::Done).contains(&pattern), "{file}: {pattern:?} would reboot a finished install");
        // Every variable it uses is in the operator guide.
        let guide = std::fs::read_to_string(dir().join("README.md")).unwrap();
        for var in text.split("${PHQ_").skip(1).map(|s| format!("PHQ_{}", s.split('}').next().unwrap())) {
            assert!(guide.contains(&format!("`{var}`")), "{file}: {var} is not documented in cloud-init/README.md");
        }
    }
}

/// The first runcmd entry, `[sh, -ec, SCRIPT, NAME, URL, SHA256]`, as JSON; None (a skip) without
/// python3's yaml module.
fn first_runcmd(file: &str) -> Option<Vec<String>> {
    let doc = user_data(file)?;
    Some(serde_json::from_value(doc["runcmd"][0].clone()).unwrap())
}

/// The user-data as JSON; None (a skip) without python3's yaml module.
fn user_data(file: &str) -> Option<serde_json::Value> {
    common::yaml(&std::fs::read_to_string(dir().join(file)).unwrap())
}

/// The user-data's own first-boot script, run with stand-ins for the package manager,
/// systemctl and the agent (each writes its arguments to a log): the package is installed
/// only when its SHA-256 is the one given, and otherwise nothing runs and the reason is said.
#[test]
fn the_package_is_installed_only_when_its_sha256_matches() {
    use std::os::unix::fs::PermissionsExt;
    if !common::needs(&[("curl", "curl"), ("sha256sum", "coreutils")]) {
        return;
    }
    for (file, installer) in FILES {
        let Some(cmd) = first_runcmd(file) else { return };
        assert_eq!(&cmd[..2], ["sh", "-ec"], "{file}");
        assert_eq!(
            &cmd[4..],
            ["${PHQ_PACKAGE_URL}", "${PHQ_PACKAGE_SHA256}"],
            "{file}: URL and checksum are arguments"
        );
        let tmp = tempfile::tempdir().unwrap();
        let bin = tmp.path().join("bin");
        std::fs::create_dir(&bin).unwrap();
        let log = tmp.path().join("calls");
        for tool in [*installer, "systemctl", "phq-agent"] {
            let stub = bin.join(tool);
            std::fs::write(&stub, format!("#!/bin/sh\necho \"$(basename \"$0\") $*\" >> '{}'\n", log.display()))
                .unwrap();
            std::fs::set_permissions(&stub, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        // The script as shipped, downloading into the test's directory instead of /run.
        let script = cmd[2].replace("/run/phq-agent.", &format!("{}/phq-agent.", tmp.path().display()));
        let package = tmp.path().join("served-package");
        std::fs::write(&package, b"the package's bytes").unwrap();
        // Well formed, but another package's.
        let other = "cc1ff1c2a2a7c0f8f2d5b0b9e8a9c3ac6c1ab1b2ab54bd6d12a2c76b15f8f0f9";
        let out = Command::new("sha256sum").arg(&package).output().unwrap();
        let actual = String::from_utf8_lossy(&out.stdout).split(' ').next().unwrap().to_string();
        let run = |sha: &str| {
            let _ = std::fs::remove_file(&log);
            let out = Command::new("sh")
                .arg("-ec")
                .arg(&script)
                .arg("phq-agent-first-boot")
                .arg(format!("file://{}", package.display()))
                .arg(sha)
                .env("PATH", format!("{}:/usr/bin:/bin", bin.display()))
                .output()
                .unwrap();
            let calls = std::fs::read_to_string(&log).unwrap_or_default();
            (out.status.code(), String::from_utf8_lossy(&out.stderr).to_string(), calls)
        };
        let (code, err, calls) = run(&actual);
        assert_eq!(code, Some(0), "{file}: {err}");
        assert!(
            calls.starts_with(&format!("{installer} install -y -q {}/phq-agent.", tmp.path().display())),
            "{file}: {calls}"
        );
        assert!(
            calls.contains("systemctl enable --now phq-agent.service\nphq-agent install --reboot never"),
            "{file}: {calls}"
        );

        let (code, err, calls) = run(other);
        assert_eq!(code, Some(1), "{file}: a wrong checksum must stop the install");
        assert!(
            err.contains(&format!("has SHA-256 {actual}, not PHQ_PACKAGE_SHA256 {other}; nothing installed")),
            "{file}: {err}"
        );
        assert!(calls.is_empty(), "{file}: ran {calls}");
        assert!(
            std::fs::read_dir(tmp.path())
                .unwrap()
                .flatten()
                .all(|e| !e.file_name().to_string_lossy().starts_with("phq-agent.")),
            "{file}: the refused package is removed"
        );

        for bad in ["", "not-a-checksum", &actual.to_uppercase()] {
            let (code, err, calls) = run(bad);
            assert_eq!(code, Some(1), "{file}: {bad:?}");
            assert!(err.contains("PHQ_PACKAGE_SHA256 must be the package's SHA-256"), "{file}: {err}");
            assert!(calls.is_empty(), "{file}: {calls}");
        }
        eprintln!("{file}: refused a wrong checksum with: {}", err_line(&run(other).1));
    }
}

fn err_line(s: &str) -> String {
    s.lines().last().unwrap_or_default().to_string()
}

/// `condition: [grep, -q, 'PATTERN', PATH]` of the user-data's power_state.
fn reboot_condition(text: &str) -> Option<(String, String)> {
    let line = text.lines().find(|l| l.trim_start().starts_with("condition: [grep, -q, "))?;
    let rest = line.split_once("[grep, -q, ")?.1.trim_end().strip_suffix(']')?;
    let (pattern, path) = rest.strip_prefix('\'')?.split_once("', ")?;
    Some((pattern.to_string(), path.trim().to_string()))
}

fn journal(status: Status) -> State {
    State {
        schema: phq_agent::install::journal::STATE_SCHEMA.into(),
        status,
        plan: "test".into(),
        started_at: "2026-12-01T00:00:00Z".into(),
        updated_at: "2026-12-01T00:00:00Z".into(),
        steps: Default::default(),
        reboot_pending_since: None,
        reboot_reason: None,
        reboots: 0,
        error: None,
        findings: vec![],
    }
}

/// The repository user-data's own script, run with stand-ins for the package manager, rpm,
/// systemctl and the agent, against keys made for the test: the repository's key is trusted
/// only when its fingerprint is the pinned one — not another key, not the right key with another
/// beside it (in one armour or in two), not with bytes after it, not a short or malformed pin —
/// and then the source is written with that key alone, as the script checked it.
#[test]
fn the_repository_key_is_trusted_only_with_its_pinned_fingerprint() {
    use std::os::unix::fs::PermissionsExt;
    if !common::needs(&[("curl", "curl"), ("gpg", "gpg"), ("python3", "python3")]) {
        return;
    }
    let keys = tempfile::tempdir().unwrap();
    let gnupg = keys.path().join("gnupg");
    std::fs::create_dir(&gnupg).unwrap();
    std::fs::set_permissions(&gnupg, std::fs::Permissions::from_mode(0o700)).unwrap();
    let gpg = |args: &[&str]| -> Vec<u8> {
        let out = Command::new("gpg").arg("--batch").args(args).env("GNUPGHOME", &gnupg).output().unwrap();
        assert!(out.status.success(), "gpg {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        out.stdout
    };
    let mut fprs = vec![];
    for who in ["platform <repo@phq.invalid>", "someone else <other@phq.invalid>"] {
        gpg(&["--passphrase", "", "--quick-gen-key", who, "ed25519", "sign", "never"]);
        let listed = String::from_utf8(gpg(&["--with-colons", "--list-keys", who])).unwrap();
        fprs.push(
            listed.lines().find_map(|l| l.strip_prefix("fpr:").map(|r| r.trim_matches(':').to_string())).unwrap(),
        );
    }
    let (ours, theirs) = (fprs[0].clone(), fprs[1].clone());
    for (file, manager) in REPO_FILES {
        let Some(doc) = user_data(file) else { return };
        let cmd: Vec<String> = serde_json::from_value(doc["runcmd"][0].clone()).unwrap();
        assert_eq!(&cmd[4..], ["${PHQ_AGENT_REPO_URL}", "${PHQ_AGENT_REPO_KEY_FINGERPRINT}"], "{file}");
        let helper = doc["write_files"]
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["path"] == "/run/phq-agent/check-key.py")
            .expect("the key checker")["content"]
            .as_str()
            .unwrap()
            .to_string();
        let key_name = if *manager == "apt-get" { "phq-agent-archive-keyring.gpg" } else { "RPM-GPG-KEY-phq-agent" };
        let export = |who: &[&str]| -> Vec<u8> {
            let mut args = vec!["--export"];
            if *manager == "dnf" {
                args.insert(0, "--armor");
            }
            args.extend(who);
            gpg(&args)
        };
        let binary = gpg(&["--export", &ours]);
        let armoured = |who: &str| gpg(&["--armor", "--export", who]);
        // A packet from a signed message, no part of any key: literal data, "b", no name, no date.
        let literal = [0xcb, 0x06, b'b', 0, 0, 0, 0, 0];
        for (case, key, pin, accepted) in [
            ("the pinned key", export(&[&ours]), ours.clone(), true),
            ("the pinned key, armoured", armoured(&ours), ours.clone(), true),
            ("another key", export(&[&theirs]), ours.clone(), false),
            ("the pinned key with another beside it", export(&[&ours, &theirs]), ours.clone(), false),
            (
                "two armoured blocks, the pinned key first",
                [armoured(&ours), armoured(&theirs)].concat(),
                ours.clone(),
                false,
            ),
            ("bytes after the armour's end", [armoured(&ours), b"more\n".to_vec()].concat(), ours.clone(), false),
            (
                "a truncated packet after the key",
                [&binary[..], &[0xcd, 0x10, b'a', b'b']].concat(),
                ours.clone(),
                false,
            ),
            ("a packet that is no part of a key after it", [&binary[..], &literal].concat(), ours.clone(), false),
            ("a short pin", export(&[&ours]), ours[24..].to_string(), false),
            ("a lower-case pin", export(&[&ours]), ours.to_lowercase(), false),
        ] {
            let tmp = tempfile::tempdir().unwrap();
            let t = tmp.path().display().to_string();
            let repo = tmp.path().join("repo");
            std::fs::create_dir_all(&repo).unwrap();
            std::fs::write(repo.join(key_name), &key).unwrap();
            for d in ["run/phq-agent", "bin", "etc/apt/sources.list.d", "etc/yum.repos.d"] {
                std::fs::create_dir_all(tmp.path().join(d)).unwrap();
            }
            std::fs::write(tmp.path().join("run/phq-agent/check-key.py"), &helper).unwrap();
            let log = tmp.path().join("calls");
            for tool in [*manager, "rpm", "systemctl", "phq-agent"] {
                let stub = tmp.path().join("bin").join(tool);
                std::fs::write(&stub, format!("#!/bin/sh\necho \"$(basename \"$0\") $*\" >> '{}'\n", log.display()))
                    .unwrap();
                std::fs::set_permissions(&stub, std::fs::Permissions::from_mode(0o755)).unwrap();
            }
            // The script as shipped, with the machine's paths moved under the test's directory.
            let script = ["/run/phq-agent/", "/etc/apt/", "/etc/pki/", "/etc/yum.repos.d/"]
                .iter()
                .fold(cmd[2].clone(), |s, p| s.replace(p, &format!("{t}{p}")));
            let out = Command::new("sh")
                .arg("-ec")
                .arg(&script)
                .arg("phq-agent-first-boot")
                .arg(format!("file://{}/", repo.display()))
                .arg(&pin)
                .env("PATH", format!("{t}/bin:/usr/bin:/bin"))
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&out.stderr).to_string();
            let calls = std::fs::read_to_string(&log).unwrap_or_default();
            if accepted {
                assert!(out.status.success(), "{file}, {case}: {err}");
                if *manager == "apt-get" {
                    let list = std::fs::read_to_string(format!("{t}/etc/apt/sources.list.d/phq-agent.list")).unwrap();
                    assert_eq!(
                        list,
                        format!(
                            "deb [signed-by={t}/etc/apt/keyrings/phq-agent.gpg] file://{}/apt stable main\n",
                            repo.display()
                        )
                    );
                    assert!(calls.starts_with("apt-get update -q\napt-get install -y -q phq-agent\n"), "{calls}");
                } else {
                    let conf = std::fs::read_to_string(format!("{t}/etc/yum.repos.d/phq-agent.repo")).unwrap();
                    for must in
                        ["gpgcheck=1\n", "repo_gpgcheck=1\n", &format!("baseurl=file://{}/rpm\n", repo.display())]
                    {
                        assert!(conf.contains(must), "{file}: {must} not in {conf}");
                    }
                    assert!(
                        calls.starts_with(&format!(
                            "rpm --import {t}/etc/pki/rpm-gpg/RPM-GPG-KEY-phq-agent\ndnf install -y -q phq-agent\n"
                        )),
                        "{calls}"
                    );
                    assert!(
                        conf.contains(&format!("gpgkey=file://{t}/etc/pki/rpm-gpg/RPM-GPG-KEY-phq-agent\n")),
                        "{conf}"
                    );
                }
                assert!(calls.contains("phq-agent install --reboot never"), "{calls}");
                // What is installed is the key the script checked, written by the helper — binary
                // for apt's signed-by, armoured for rpm — never the downloaded file.
                let installed = if *manager == "apt-get" {
                    std::fs::read(format!("{t}/etc/apt/keyrings/phq-agent.gpg")).unwrap()
                } else {
                    let armoured = format!("{t}/etc/pki/rpm-gpg/RPM-GPG-KEY-phq-agent");
                    if common::have("rpmkeys") || common::in_ci() {
                        let db = tmp.path().join("rpmdb");
                        std::fs::create_dir(&db).unwrap();
                        let out =
                            Command::new("rpmkeys").arg("--dbpath").arg(&db).args(["--import", &armoured]).output();
                        assert!(
                            out.as_ref().is_ok_and(|o| o.status.success()),
                            "{file}, {case}: rpmkeys --import: {out:?}"
                        );
                    }
                    gpg(&["--dearmor", "--output", "-", &armoured])
                };
                assert!(installed == binary, "{file}, {case}: the installed key is not exactly the pinned one");
            } else {
                assert_eq!(out.status.code(), Some(1), "{file}, {case}: accepted ({calls})");
                assert!(err.contains("nothing installed"), "{file}, {case}: {err}");
                assert!(calls.is_empty(), "{file}, {case}: ran {calls}");
                assert!(
                    !std::path::Path::new(&format!("{t}/etc/apt/keyrings/phq-agent.gpg")).exists(),
                    "{file}, {case}"
                );
                eprintln!("{file}, {case}: {}", err.trim());
            }
        }
    }
}

/// Values an operator would set, every one well formed: one set with NVIDIA's repository and a
/// platform, one with a mirror (its key pinned), a package from a disk and no platform.
fn good_values() -> Vec<Vec<(&'static str, String)>> {
    let common = |url: &str, token: &str| {
        vec![
            ("PHQ_PACKAGE_SHA256", "5e1a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f708192a3b4c5d6e7f8".to_string()),
            ("PHQ_HTTP_TOKEN", "3b9f2c0e4a7d1f6b8c5e2a9d0f3b7c1e".to_string()),
            ("PHQ_PLATFORM_URL", url.to_string()),
            ("PHQ_PLATFORM_TOKEN", token.to_string()),
            ("PHQ_CUDA", "12.9".to_string()),
            ("PHQ_DRIVER_BRANCH", "580".to_string()),
            ("PHQ_AGENT_REPO_KEY_FINGERPRINT", "0123456789ABCDEF0123456789ABCDEF01234567".to_string()),
        ]
    };
    // A CA bundle's PEM as the guide has it made: `base64 -w0 ca.pem`.
    let ca = "-----BEGIN CERTIFICATE-----\nMIIBdzCCAR2gAwIBAgIUKubeVirtTestCA==\n-----END CERTIFICATE-----\n";
    let mut nvidia = common("https://gpu-platform.example", "platform-token_0123-4567.89~ab+cd/ef=");
    nvidia.extend([
        ("PHQ_PACKAGE_URL", "https://artifacts.example/phq-agent_0.1.0-1_amd64.deb".to_string()),
        ("PHQ_REPO_URL", String::new()),
        ("PHQ_REPO_KEY_FINGERPRINT", String::new()),
        ("PHQ_AGENT_REPO_URL", "https://repo.example/phq-agent".to_string()),
        ("PHQ_VSOCK_PORT", "9440".to_string()),
        ("PHQ_VSOCK_CA_B64", base64::Engine::encode(&base64::engine::general_purpose::STANDARD, ca)),
    ]);
    let mut mirror = common("", "");
    mirror.extend([
        ("PHQ_PACKAGE_URL", "file:///mnt/phq/phq-agent-0.1.0-1.x86_64.rpm".to_string()),
        ("PHQ_REPO_URL", "https://mirror.example:8443/nvidia/compute/cuda/repos;v=1/%2F".to_string()),
        ("PHQ_REPO_KEY_FINGERPRINT", "FEDCBA9876543210FEDCBA9876543210FEDCBA98".to_string()),
        ("PHQ_AGENT_REPO_URL", "file:///mnt/phq-repo".to_string()),
        ("PHQ_VSOCK_PORT", "4294967294".to_string()),
        ("PHQ_VSOCK_CA_B64", String::new()),
    ]);
    vec![nvidia, mirror]
}

/// `cloud-init/render FILE` with only `vars` (and PATH) in its environment: (exit code, stdout, stderr).
fn render(file: &str, vars: &[(&str, String)]) -> (Option<i32>, String, String) {
    let out = Command::new(dir().join("render"))
        .arg(dir().join(file))
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .envs(vars.iter().map(|(k, v)| (*k, v.as_str())))
        .output()
        .unwrap_or_else(|e| panic!("run cloud-init/render: {e}"));
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The `PHQ_` variables a file uses, in order of use.
fn variables(text: &str) -> Vec<String> {
    text.split("${PHQ_").skip(1).map(|s| format!("PHQ_{}", s.split('}').next().unwrap())).collect()
}

/// The operator guide fills the files in with `cloud-init/render`, which checks every value and
/// then runs envsubst (the real one) on the `PHQ_` variables alone: the result is the file with
/// exactly those filled in, nothing else touched, and what cloud-init and the agent read from it
/// is each value as it was given — the script's arguments, the config drop-in (read by the
/// agent's own config loader), the tokens.
#[test]
fn render_fills_in_the_variables_and_leaves_everything_else_alone() {
    if !common::needs(&[("envsubst", "gettext-base")]) {
        return;
    }
    for (file, _) in FILES.iter().chain(REPO_FILES) {
        let text = std::fs::read_to_string(dir().join(file)).unwrap();
        for vars in good_values() {
            let (code, filled, err) = render(file, &vars);
            assert_eq!(code, Some(0), "{file}: {err}");
            assert!(err.is_empty(), "{file}: {err}");
            let value = |name: &str| vars.iter().find(|(k, _)| *k == name).unwrap().1.clone();
            let expected =
                variables(&text).iter().fold(text.clone(), |t, v| t.replace(&format!("${{{v}}}"), &value(v)));
            assert_eq!(filled, expected, "{file}: render changed more than the PHQ_ variables");
            assert!(!filled.contains("${PHQ_"), "{file}");

            let (Some(doc), Some(raw)) = (common::yaml(&filled), common::yaml(&text)) else { return };
            let cmd: Vec<String> = serde_json::from_value(doc["runcmd"][0].clone()).unwrap();
            let raw: Vec<String> = serde_json::from_value(raw["runcmd"][0].clone()).unwrap();
            let args: Vec<String> = raw[4..].iter().map(|a| value(&variables(a)[0])).collect();
            assert_eq!(cmd[..4], raw[..4], "{file}: the script itself");
            assert_eq!(cmd[4..], args[..], "{file}: the script's arguments, each the value given");
            let written = |path: &str| {
                doc["write_files"].as_array().unwrap().iter().find(|f| f["path"] == path).unwrap()["content"]
                    .as_str()
                    .unwrap()
                    .to_string()
            };
            assert_eq!(written("/etc/phq-agent/token"), value("PHQ_HTTP_TOKEN"), "{file}");
            assert_eq!(written("/etc/phq-agent/platform-token"), value("PHQ_PLATFORM_TOKEN"), "{file}");
            let dropin = written("/etc/phq-agent/config.d/50-cloud-init.toml");
            let config = phq_agent::config::from_files(&[("50-cloud-init.toml".into(), dropin.clone())])
                .unwrap_or_else(|e| panic!("{file}: the agent refuses the rendered drop-in ({e}):\n{dropin}"));
            assert_eq!(config.platform.url, value("PHQ_PLATFORM_URL"), "{file}");
            assert_eq!(config.install.cuda, value("PHQ_CUDA"), "{file}");
            assert_eq!(config.install.driver_branch, value("PHQ_DRIVER_BRANCH"), "{file}");
            assert_eq!(config.install.repo_url, value("PHQ_REPO_URL"), "{file}");
            assert_eq!(config.install.repo_key_fingerprint, value("PHQ_REPO_KEY_FINGERPRINT"), "{file}");
            assert_eq!(config.vsock.port.to_string(), value("PHQ_VSOCK_PORT"), "{file}");
            let ca = doc["write_files"].as_array().unwrap().iter().find(|f| f["path"] == "/etc/phq-agent/vsock-ca.pem");
            let ca = ca.unwrap_or_else(|| panic!("{file}: no CA bundle written"));
            assert_eq!((&ca["encoding"], &ca["content"]), (&"b64".into(), &value("PHQ_VSOCK_CA_B64").into()), "{file}");
            assert_eq!(
                config.vsock.client_ca,
                std::path::Path::new("/etc/phq-agent/vsock-ca.pem"),
                "{file}: where the agent looks"
            );
            // systemd binds the vsock port before the agent reads its config: the socket unit's
            // drop-in must name the same port, after an empty ListenStream= that drops the
            // unit's own 9440 (systemd.socket(5)), or the agent is passed 9440 and says so.
            let socket = written("/etc/systemd/system/phq-agent-vsock.socket.d/port.conf");
            let listens: Vec<&str> = socket.lines().filter_map(|l| l.strip_prefix("ListenStream=")).collect();
            assert!(socket.starts_with("[Socket]\n"), "{file}: {socket}");
            assert_eq!(listens, ["", &format!("vsock:4294967295:{}", config.vsock.port)], "{file}: {socket}");
        }
    }
}

/// Hostile or mistaken values never reach the user-data: render checks every `PHQ_` variable the
/// file uses before it substitutes anything, and on a bad one exits non-zero with nothing on
/// stdout and a message that names the variable and the expected form — and never shows a
/// token. (Plain envsubst, which the guide used before, lets the first case below add an
/// argument to the script and put the attacker's checksum in the place of the real one.)
#[test]
fn render_refuses_a_value_that_could_break_out_and_prints_nothing() {
    if !common::needs(&[("envsubst", "gettext-base")]) {
        return;
    }
    let attacker = "d".repeat(64);
    let sha = "5e1a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f708192a3b4c5d6e7f8";
    let hostile_url = format!("https://artifacts.example/phq-agent.deb\"\n    - \"{attacker}");
    // (file, variable, value — None: unset)
    let cases: Vec<(&str, &str, Option<String>)> = vec![
        ("ubuntu-22.04.yaml", "PHQ_PACKAGE_URL", Some(hostile_url.clone())),
        ("ubuntu-22.04.yaml", "PHQ_PACKAGE_URL", Some("https://artifacts.example/a b.deb".into())),
        ("rhel-9.yaml", "PHQ_PACKAGE_URL", Some("ftp://artifacts.example/phq-agent.rpm".into())),
        ("rhel-9.yaml", "PHQ_PACKAGE_URL", Some("https://artifacts.example/$(reboot).rpm".into())),
        ("debian-12.yaml", "PHQ_PACKAGE_URL", Some(String::new())),
        (
            "ubuntu-24.04.yaml",
            "PHQ_REPO_URL",
            Some("https://mirror.example/repos\"\nrepo_key_fingerprint = \"\"\n# \"".into()),
        ),
        ("ubuntu-24.04.yaml", "PHQ_REPO_URL", Some("https://mirror.example/repos\\nx".into())),
        ("ubuntu-24.04.yaml", "PHQ_REPO_URL", Some("https://mirror.example/repos\n".into())),
        ("debian-12.yaml", "PHQ_REPO_URL", Some("[trusted=yes] http://evil.example/ ./".into())),
        ("debian-12.yaml", "PHQ_REPO_URL", Some("https://evil.example/[trusted=yes]".into())),
        ("debian-12.yaml", "PHQ_REPO_URL", Some("https://mirror.example/repos?x=1".into())),
        ("apt-repository.yaml", "PHQ_AGENT_REPO_URL", Some("https://repo.example/#x".into())),
        ("apt-repository.yaml", "PHQ_AGENT_REPO_URL", Some("https://repo.example/ [trusted=yes]".into())),
        ("dnf-repository.yaml", "PHQ_AGENT_REPO_URL", Some("https://repo.example/\ngpgcheck=0".into())),
        ("dnf-repository.yaml", "PHQ_AGENT_REPO_URL", Some(String::new())),
        ("rhel-9.yaml", "PHQ_PLATFORM_URL", Some("file:///etc/shadow".into())),
        ("rhel-9.yaml", "PHQ_PLATFORM_URL", Some("https://gpu-platform.example'".into())),
        ("ubuntu-22.04.yaml", "PHQ_HTTP_TOKEN", Some("secret-0123456789\"\nx".into())),
        ("ubuntu-22.04.yaml", "PHQ_HTTP_TOKEN", Some("secret-01234".into())),
        ("ubuntu-22.04.yaml", "PHQ_HTTP_TOKEN", Some("secret-0123456789 abcdef".into())),
        ("apt-repository.yaml", "PHQ_PLATFORM_TOKEN", Some("secret-0123456789\\".into())),
        ("apt-repository.yaml", "PHQ_PLATFORM_TOKEN", Some("secret-0123456789`id`".into())),
        ("ubuntu-22.04.yaml", "PHQ_PACKAGE_SHA256", Some(sha.to_uppercase())),
        ("ubuntu-22.04.yaml", "PHQ_PACKAGE_SHA256", Some(sha[1..].to_string())),
        ("ubuntu-22.04.yaml", "PHQ_PACKAGE_SHA256", Some(format!("{sha}\n"))),
        ("rhel-9.yaml", "PHQ_PACKAGE_SHA256", None),
        (
            "apt-repository.yaml",
            "PHQ_AGENT_REPO_KEY_FINGERPRINT",
            Some("0123456789abcdef0123456789abcdef01234567".into()),
        ),
        (
            "apt-repository.yaml",
            "PHQ_AGENT_REPO_KEY_FINGERPRINT",
            Some("0123 4567 89AB CDEF 0123  4567 89AB CDEF 0123 4567".into()),
        ),
        ("dnf-repository.yaml", "PHQ_AGENT_REPO_KEY_FINGERPRINT", Some(String::new())),
        ("debian-12.yaml", "PHQ_REPO_KEY_FINGERPRINT", Some("89ABCDEF01234567".into())),
        ("debian-12.yaml", "PHQ_REPO_URL", None),
        ("debian-12.yaml", "PHQ_REPO_KEY_FINGERPRINT", None),
        ("rhel-9.yaml", "PHQ_PLATFORM_TOKEN", None),
        ("rhel-9.yaml", "PHQ_PLATFORM_TOKEN", Some(String::new())),
        ("ubuntu-24.04.yaml", "PHQ_CUDA", Some("12.9\"".into())),
        ("ubuntu-24.04.yaml", "PHQ_CUDA", Some("11.8".into())),
        ("ubuntu-24.04.yaml", "PHQ_DRIVER_BRANCH", Some("580\n".into())),
        ("ubuntu-24.04.yaml", "PHQ_DRIVER_BRANCH", Some("latest".into())),
        ("debian-12.yaml", "PHQ_VSOCK_PORT", Some("0".into())),
        ("debian-12.yaml", "PHQ_VSOCK_PORT", Some("4294967295".into())),
        ("debian-12.yaml", "PHQ_VSOCK_PORT", Some("9440\n[http]\nenabled = false".into())),
        ("debian-12.yaml", "PHQ_VSOCK_PORT", Some(String::new())),
        ("rhel-9.yaml", "PHQ_VSOCK_CA_B64", Some("-----BEGIN CERTIFICATE-----".into())),
        ("rhel-9.yaml", "PHQ_VSOCK_CA_B64", Some("TUlJQg\"\n    x: \"".into())),
        ("rhel-9.yaml", "PHQ_VSOCK_CA_B64", Some("TUlJQg=".into())),
        ("rhel-9.yaml", "PHQ_VSOCK_CA_B64", None),
    ];
    let secret = |var: &str| var.ends_with("_TOKEN");
    for (file, var, value) in &cases {
        let mut vars = good_values().remove(0);
        vars.retain(|(k, _)| k != var);
        if let Some(v) = value {
            vars.push((var, v.clone()));
        }
        let (code, out, err) = render(file, &vars);
        let case = format!("{file}, {var}={value:?}");
        assert!(code.is_some_and(|c| c != 0), "{case}: exit {code:?}, rendered:\n{out}");
        assert!(out.is_empty(), "{case}: wrote to stdout:\n{out}");
        assert!(err.contains(var) && err.contains("expected"), "{case}: {err}");
        if let (true, Some(v)) = (secret(var), value.as_deref().filter(|v| !v.is_empty())) {
            assert!(!err.contains(&v[..12.min(v.len())]), "{case}: the error shows the token: {err}");
        }
        eprintln!("{case}: {}", err.trim());
    }
    // Also when the bad value is only one of several: nothing comes out, and every bad one is named.
    let mut vars = good_values().remove(0);
    vars.retain(|(k, _)| !["PHQ_PACKAGE_URL", "PHQ_CUDA"].contains(k));
    vars.extend([("PHQ_PACKAGE_URL", hostile_url.clone()), ("PHQ_CUDA", "13".to_string())]);
    let (code, out, err) = render("ubuntu-22.04.yaml", &vars);
    assert!(code.is_some_and(|c| c != 0) && out.is_empty(), "{err}");
    assert!(err.contains("PHQ_PACKAGE_URL") && err.contains("PHQ_CUDA"), "{err}");

    // Why: the same value through plain envsubst adds an argument, and the script's $2 — the
    // checksum it compares — becomes the attacker's.
    let text = std::fs::read_to_string(dir().join("ubuntu-22.04.yaml")).unwrap();
    let mut c = Command::new("envsubst");
    c.env_clear().env("PATH", "/usr/bin:/bin").stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped());
    vars.retain(|(k, _)| k != &"PHQ_CUDA");
    vars.push(("PHQ_CUDA", "12.9".into()));
    c.envs(vars.iter().map(|(k, v)| (*k, v.as_str())));
    let mut child = c.spawn().unwrap();
    std::io::Write::write_all(child.stdin.as_mut().unwrap(), text.as_bytes()).unwrap();
    drop(child.stdin.take());
    let filled = String::from_utf8(child.wait_with_output().unwrap().stdout).unwrap();
    let Some(doc) = common::yaml(&filled) else { return };
    let cmd: Vec<String> = serde_json::from_value(doc["runcmd"][0].clone()).unwrap();
    assert_eq!(cmd[5], attacker, "plain envsubst: {cmd:?}");
}
