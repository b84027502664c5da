//! `phq-agent serve`: parses, builds the runtime, and starts the service (`serve::run`).

use anyhow::Context;
use clap::Args;

#[derive(Debug, Args)]
pub struct Serve {
    #[command(flatten)]
    pub machine: super::Machine,
}

impl Serve {
    pub fn run(self, g: &super::Global) -> anyhow::Result<i32> {
        // Before any thread exists: glibc reads its tuning once, as the first arena is made.
        crate::serve::memory::tune();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(crate::serve::memory::RUNTIME_WORKERS)
            .enable_all()
            .build()
            .context("cannot start the async runtime")?;
        let machine =
            crate::serve::Machine { sysroot: self.machine.sysroot.clone(), nvml_lib: self.machine.nvml_lib.clone() };
        let code = runtime.block_on(crate::serve::run(|| g.load_config(), machine));
        // A snapshot still running on the blocking pool (a stop during the first one) is not
        // waited for: the process is ending.
        runtime.shutdown_background();
        code
    }
}
