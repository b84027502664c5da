//! The real runner against real programs, and how a failed command reads.

use super::*;

/// The real runner hands the input to the program's stdin, and a program that never reads
/// it (a pipe closed under a large write) neither hangs nor fails the call.
#[test]
fn the_system_runner_writes_stdin_and_survives_a_program_that_ignores_it() {
    let mut r = SystemRunner { log: None };
    let out = r.run_input("cat", &[], b"one\ntwo\n").unwrap();
    assert!(out.ok());
    assert_eq!(out.stdout, b"one\ntwo\n");
    let out = r.run_input("true", &[], &vec![b'x'; 4 << 20]).unwrap();
    assert!(out.ok());
}

/// The real runner stops reading when told, and the writer with it: `yes` writes without
/// end, and the call returns once the reader has had 1 MiB.
#[test]
fn the_system_runner_stops_a_writer_whose_output_is_no_longer_read() {
    let mut r = SystemRunner { log: None };
    let mut got = 0u64;
    let started = Instant::now();
    let out = r
        .run_reading("yes", &[], &mut |stdout| {
            got = std::io::copy(&mut stdout.take(1 << 20), &mut std::io::sink()).unwrap();
        })
        .unwrap();
    assert_eq!(got, 1 << 20);
    assert!(!out.ok(), "yes ends on the closed pipe: {out:?}");
    assert!(started.elapsed() < Duration::from_secs(30));
    // A program that ends on its own keeps its status and stderr.
    let out = r.run_reading("ls", &["/nonexistent-phq".into()], &mut |_| {}).unwrap();
    assert!(!out.ok() && out.stderr.contains("nonexistent-phq"), "{out:?}");
}

/// A failed command says what ran (quoted as a person would type it), how it ended, and the
/// last lines it printed, stdout's before stderr's.
#[test]
fn a_failed_command_names_itself_its_status_and_its_last_words() {
    let out = Output {
        code: Some(100),
        stdout: b"Reading package lists...\n nvidia-driver-cuda : Depends: nvidia-support but it is not installable\n"
            .to_vec(),
        stderr: "E: Unable to correct problems, you have held broken packages.\n".into(),
    };
    let e = CommandError::new("apt-get", &["install".into(), "a b".into()], &out);
    assert_eq!(e.status, Some(100));
    assert_eq!(e.stderr_tail, ["E: Unable to correct problems, you have held broken packages."]);
    assert_eq!(
        e.to_string(),
        "`apt-get install 'a b'` exited 100: Reading package lists... / nvidia-driver-cuda : Depends: nvidia-support but it is not installable / E: Unable to correct problems, you have held broken packages."
    );
    let killed = CommandError::new("dpkg-deb", &[], &Output { code: None, stdout: vec![], stderr: String::new() });
    assert_eq!(killed.to_string(), "`dpkg-deb` exited on a signal: ");
    let many: String = (1..=9).map(|i| format!("line {i}\n")).collect();
    let e = CommandError::new("x", &[], &Output { code: Some(1), stdout: many.into_bytes(), stderr: "last\n".into() });
    assert!(e.to_string().ends_with("line 5 / line 6 / line 7 / line 8 / line 9 / last"), "{e}");
}
