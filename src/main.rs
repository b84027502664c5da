use clap::Parser;
use phq_agent::cli::{Cli, EXIT_USAGE};

fn main() {
    // CUDA numbers GPUs fastest-first unless told otherwise, and reads this once, at cuInit.
    // Set here, before any thread exists and before anything can load CUDA, so a CUDA ordinal
    // is the index nvidia-smi prints (CUDA programming guide, "CUDA Environment Variables").
    // Always: a CUDA_DEVICE_ORDER the user exported for their applications must not renumber
    // the agent's GPUs; it affects this process only.
    std::env::set_var("CUDA_DEVICE_ORDER", "PCI_BUS_ID");
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
