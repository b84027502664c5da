//! The README's commands run as written (issue 52): every command in a fenced `sh` block of
//! README.md is run from the repository's root with `bash -c`, in the README's order, and must
//! exit as the README says — 0, or the code a trailing `# exits N` names (doctor's 1, 2 and 3
//! are warn, fail and unknown findings: a try-it line that shows a failing GPU exits 2).
//!
//! A command is a line, a line continued with `\`, or a line with a here-document and its body.
//! Not run, each for the reason `exempt` gives: the two commands themselves (`scripts/test`
//! would run this test again; `cargo run --release -- doctor` builds the agent and judges the
//! live machine, whose verdict is whatever it is), and anything that changes the machine
//! (`sudo`, `apt-get`, `systemctl`, the word `install`: the installer's, apt's or cargo's; and a
//! `serve` not held by `timeout`).
//! The try-it lines call `target/release/phq-agent`, which the first command builds: without
//! it the test skips, and under CI (where `scripts/test` has built it with the packages) fails.
//!
//! Each command runs in a session of its own, so what it leaves running in the background (the
//! service the try-it starts under `timeout`) is found and stopped when the test ends.

mod common;
use common::*;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// One command of the README, with the line it starts on.
#[derive(Debug)]
struct ReadmeCommand {
    line: usize,
    text: String,
    /// The exit code the README promises: 0, or a trailing `# exits N`.
    exits: i32,
}

/// The commands of every fenced `sh` block, in order; comment lines and blank lines left out.
fn commands(readme: &str) -> Vec<ReadmeCommand> {
    let lines: Vec<&str> = readme.lines().collect();
    let mut out = vec![];
    let mut in_sh = false;
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        let trimmed = line.trim();
        if trimmed.starts_with("```") {
            in_sh = !in_sh && trimmed == "```sh";
            i += 1;
            continue;
        }
        if !in_sh || trimmed.is_empty() || trimmed.starts_with('#') {
            i += 1;
            continue;
        }
        let start = i + 1;
        let mut text = String::new();
        let mut exits = 0;
        let mut heredoc: Option<String> = None;
        loop {
            let l = lines[i];
            if let Some(n) = exit_comment(l) {
                exits = n;
            }
            if heredoc.is_none() {
                heredoc = heredoc_word(l);
            }
            text.push_str(l);
            text.push('\n');
            i += 1;
            if let Some(word) = &heredoc {
                // The body, through the line that ends it.
                while i < lines.len() {
                    text.push_str(lines[i]);
                    text.push('\n');
                    i += 1;
                    if lines[i - 1].trim() == word {
                        break;
                    }
                }
                break;
            }
            if !l.trim_end().ends_with('\\') || i >= lines.len() {
                break;
            }
        }
        out.push(ReadmeCommand { line: start, text, exits });
    }
    out
}

/// `N` of a trailing `# exits N`.
fn exit_comment(line: &str) -> Option<i32> {
    let (_, comment) = line.rsplit_once('#')?;
    comment.trim().strip_prefix("exits ")?.trim().parse().ok()
}

/// The word that ends a here-document this line opens (`<<'EOF'`, `<<EOF`, `<<-EOF`).
fn heredoc_word(line: &str) -> Option<String> {
    let (_, rest) = line.split_once("<<")?;
    let rest = rest.strip_prefix('-').unwrap_or(rest);
    let word: String = rest
        .trim_start()
        .trim_start_matches(['\'', '"'])
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect();
    (!word.is_empty()).then_some(word)
}

/// Why a command is not run, or None to run it.
fn exempt(text: &str) -> Option<&'static str> {
    let words: Vec<&str> = text.lines().flat_map(|l| l.split('#').next().unwrap_or("").split_whitespace()).collect();
    let has = |w: &str| words.contains(&w);
    if text.trim() == "scripts/test" {
        return Some("the test command itself: it would run this test again");
    }
    if text.trim() == "cargo run --release -- doctor" {
        return Some("the main job: it builds the agent and judges this machine, whatever its verdict");
    }
    if has("sudo") || has("apt-get") || has("systemctl") || has("install") {
        return Some("changes the machine");
    }
    if has("serve") && !has("timeout") {
        return Some("runs the service with no end");
    }
    None
}

/// A command's run: its exit code (None: killed at the deadline) and what it printed.
fn run(repo: &Path, cmd: &ReadmeCommand, sessions: &mut Sessions) -> (Option<i32>, String) {
    use std::os::unix::process::CommandExt;
    let log = tempfile::NamedTempFile::new().unwrap();
    let mut bash = Command::new("bash");
    bash.arg("-c").arg(&cmd.text).current_dir(repo).stdin(Stdio::null());
    // A file, not a pipe: a background job keeps its output open, and the test must not wait
    // for it to exit.
    // One open file for both, as `>log 2>&1` makes: they share its offset.
    let out = log.reopen().unwrap();
    bash.stdout(out.try_clone().unwrap()).stderr(out);
    // SAFETY: setsid(2) is async-signal-safe and touches no memory of this process.
    unsafe {
        bash.pre_exec(|| if libc::setsid() < 0 { Err(std::io::Error::last_os_error()) } else { Ok(()) });
    }
    let mut child = bash.spawn().unwrap_or_else(|e| panic!("README.md:{}: cannot run bash: {e}", cmd.line));
    sessions.0.push(child.id() as i32);
    // Long enough for a release build of the fakes on a busy 2-core machine.
    let deadline = Instant::now() + Duration::from_secs(900);
    let code = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status.code();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let output = String::from_utf8_lossy(&std::fs::read(log.path()).unwrap_or_default()).into_owned();
    (code, output)
}

/// The sessions the commands ran in; whatever is still running in them is stopped on drop.
struct Sessions(Vec<i32>);

impl Drop for Sessions {
    fn drop(&mut self) {
        let left = |sessions: &[i32]| -> Vec<i32> {
            std::fs::read_dir("/proc")
                .into_iter()
                .flatten()
                .flatten()
                .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
                .filter(|pid| session_of(*pid).is_some_and(|s| sessions.contains(&s)))
                .collect()
        };
        for signal in [libc::SIGTERM, libc::SIGKILL] {
            let pids = left(&self.0);
            if pids.is_empty() {
                return;
            }
            for pid in pids {
                // SAFETY: kill(2) on a process this test started (its session is one of ours).
                unsafe { libc::kill(pid, signal) };
            }
            let until = Instant::now() + Duration::from_secs(5);
            while !left(&self.0).is_empty() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

/// The session id of a process (field 6 of /proc/PID/stat, after the command's parentheses).
fn session_of(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.split_whitespace().nth(3)?.parse().ok()
}

#[test]
fn every_command_in_the_readme_runs_as_written() {
    let repo = repo();
    let readme = std::fs::read_to_string(repo.join("README.md")).unwrap();
    let all = commands(&readme);
    assert!(all.len() >= 8, "README.md: only {} commands found in its sh blocks: {all:#?}", all.len());
    if !repo.join("target/release/phq-agent").is_file() {
        skip("no target/release/phq-agent: the README's first command builds it (cargo run --release -- doctor)");
        return;
    }
    if !needs(&[("curl", "curl"), ("timeout", "coreutils"), ("prometheus", "prometheus"), ("python3", "python3")]) {
        return;
    }
    let mut sessions = Sessions(vec![]);
    let mut ran = 0;
    for cmd in &all {
        if let Some(why) = exempt(&cmd.text) {
            eprintln!("README.md:{}: not run ({why}): {}", cmd.line, cmd.text.trim());
            continue;
        }
        let started = Instant::now();
        let (code, output) = run(repo, cmd, &mut sessions);
        eprintln!("README.md:{}: exit {code:?} in {:.1} s", cmd.line, started.elapsed().as_secs_f64());
        assert!(
            code == Some(cmd.exits),
            "README.md:{}: exited {} where the README says {}:\n{}\n--- its output (the end):\n{}",
            cmd.line,
            code.map_or("by no code (killed at its deadline)".into(), |c| c.to_string()),
            cmd.exits,
            cmd.text.trim_end(),
            tail(&output, 6000)
        );
        ran += 1;
    }
    assert!(ran >= 6, "only {ran} README commands ran");
}

fn tail(s: &str, n: usize) -> &str {
    let mut at = s.len().saturating_sub(n);
    while !s.is_char_boundary(at) {
        at += 1;
    }
    &s[at..]
}

#[test]
fn the_parser_reads_continuations_heredocs_and_expected_exits() {
    let md = "text\n```sh\n# a comment\nfoo \\\n  --bar   # exits 2\n\ncat > f <<'EOF'\na = 1\nEOF\nscripts/test\nsudo x\n```\n```\nnot sh\n```\n";
    let c = commands(md);
    assert_eq!(c.len(), 4, "{c:#?}");
    assert_eq!((c[0].line, c[0].exits), (4, 2));
    assert_eq!(c[0].text, "foo \\\n  --bar   # exits 2\n");
    assert_eq!(c[1].text, "cat > f <<'EOF'\na = 1\nEOF\n");
    assert_eq!(c[1].exits, 0);
    assert!(exempt(&c[2].text).is_some() && exempt(&c[3].text).is_some());
    assert!(exempt("timeout 5 phq-agent serve &").is_none());
    assert!(exempt("phq-agent serve").is_some());
    assert!(exempt("phq-agent install --dry-run").is_some());
    assert!(exempt("grep installed f").is_none());
}
