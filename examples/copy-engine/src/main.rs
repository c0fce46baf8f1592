//! `copy-engine SOCKET`: serve the copy engine on SOCKET until Ctrl-C or SIGTERM, for QEMU
//! 10.1+ (`-device '{"driver":"vfio-user-pci","socket":{"type":"unix","path":"SOCKET"}}'`
//! with a shared memfd memory backend: the engine pins guest pages; see the umdev README).
#![forbid(unsafe_code)]

use copy_engine::CopyEngine;
use umdev::dma::{DmaConfig, DmaSpace};
use umdev::pci::PciAdapter;
use umdev::server::{Server, ServerConfig, TerminationSignals};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Before any thread starts, so that the signals reach `serve_until_signal`.
    let signals = TerminationSignals::block();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let Some(socket) = std::env::args().nth(1) else {
        return Err("usage: copy-engine SOCKET".into());
    };
    let device = PciAdapter::new(CopyEngine::default())?;
    let dma = DmaSpace::new(DmaConfig::default());
    let server = Server::new(ServerConfig::new(&socket), Box::new(device), dma.clone()).spawn()?;
    println!("serving the copy engine on {socket} (Ctrl-C to stop)");
    Ok(signals.serve_until_signal(server, &dma)?)
}
