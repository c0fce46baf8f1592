//! `umdev completions SHELL` and `umdev man`: generated from the clap definitions
//! (clap_complete, clap_mangen), so they never fall behind the commands.

use std::io::Write;
use std::path::PathBuf;

use clap_complete::Shell;

use crate::CliResult;

/// Arguments of `umdev completions`.
#[derive(clap::Args, Debug)]
#[command(after_help = "\
Install, e.g.:
  umdev completions bash > ~/.local/share/bash-completion/completions/umdev
  umdev completions zsh  > \"${fpath[1]}/_umdev\"
  umdev completions fish > ~/.config/fish/completions/umdev.fish")]
pub struct CompletionsArgs {
    /// The shell to complete for.
    #[arg(value_enum)]
    pub shell: Shell,
}

/// Arguments of `umdev man`.
#[derive(clap::Args, Debug)]
#[command(after_help = "\
Read it with `umdev man | man -l -`; install with
  umdev man --out-dir /usr/local/share/man/man1")]
pub struct ManArgs {
    /// Write umdev.1 and one umdev-<subcommand>.1 per subcommand into DIR (created if
    /// missing) instead of printing umdev.1.
    #[arg(long, value_name = "DIR")]
    pub out_dir: Option<PathBuf>,
}

/// Why the man pages could not be written.
#[derive(Debug, thiserror::Error)]
pub enum ManError {
    /// The output directory or a page in it.
    #[error("cannot write the man pages into {}", dir.display())]
    Write {
        /// The directory.
        dir: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Standard output.
    #[error("cannot write the man page to stdout")]
    Stdout(#[source] std::io::Error),
}

/// Print the completion script of `args.shell` for `cmd`.
pub fn completions(args: CompletionsArgs, mut cmd: clap::Command) -> CliResult {
    let mut out = Vec::new();
    clap_complete::generate(args.shell, &mut cmd, "umdev", &mut out);
    write_stdout(&out).map_err(|e| format!("cannot write the completion script: {e}"))?;
    Ok(())
}

/// Print `cmd`'s man page, or write every page into `args.out_dir`.
pub fn man(args: ManArgs, cmd: clap::Command) -> CliResult {
    match args.out_dir {
        None => {
            let mut out = Vec::new();
            clap_mangen::Man::new(cmd)
                .render(&mut out)
                .map_err(ManError::Stdout)?;
            write_stdout(&out).map_err(ManError::Stdout)?;
        }
        Some(dir) => {
            let err = |source| ManError::Write {
                dir: dir.clone(),
                source,
            };
            std::fs::create_dir_all(&dir).map_err(err)?;
            clap_mangen::generate_to(cmd, &dir).map_err(err)?;
            let mut pages: Vec<String> = std::fs::read_dir(&dir)
                .map_err(err)?
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("umdev") && n.ends_with(".1"))
                .collect();
            pages.sort();
            eprintln!("wrote {} pages into {}", pages.len(), dir.display());
        }
    }
    Ok(())
}

/// Write all of `bytes` to stdout; a closed pipe (`| head`) is not an error.
fn write_stdout(bytes: &[u8]) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    match out.write_all(bytes).and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => r,
    }
}
