use clap::Parser;
use phq_agent::cli::{Cli, EXIT_USAGE};

fn main() {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            // --help and --version are not errors; everything else clap rejects is a usage error.
            let code = if e.use_stderr() { EXIT_USAGE } else { 0 };
            let _ = e.print();
            std::process::exit(code);
        }
    };
    std::process::exit(cli.run());
}
