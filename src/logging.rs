//! The log on stderr: `RUST_LOG` filters it (info or warn by default, per command); colour
//! only for a terminal; and, when stderr is the journal, the journal's form.
//!
//! **The journal** (systemd's `StandardError=journal`, the default for a service): systemd
//! sets `JOURNAL_STREAM=DEV:INO` to the device and inode of the stream it connected to
//! stderr. When they match stderr's (`fstat`: so a child whose stderr was redirected does not
//! take the form), each line is written without a timestamp (the journal stamps every line
//! itself) and opened with its syslog priority, `<3>` error, `<4>` warn, `<6>` info, `<7>`
//! debug and trace (`sd-daemon(3)`), so `journalctl -p warning` filters by level; colour is
//! off there.

use std::fmt;
use std::os::fd::AsRawFd;

use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::EnvFilter;

/// Set up the log; `default_level` applies without `RUST_LOG`.
pub fn init(default_level: &str) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if stderr_is_journal() {
        let format = tracing_subscriber::fmt::format()
            .without_time()
            .with_ansi(false);
        builder
            .with_ansi(false)
            .event_format(SyslogPriority(format))
            .init();
    } else {
        // Colour codes only for a terminal: a log file or a pipe gets plain text.
        builder.with_ansi(log_colours()).init();
    }
}

/// Colour log lines when stderr is a terminal and `NO_COLOR` is not set (no-color.org).
fn log_colours() -> bool {
    use std::io::IsTerminal;
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// `JOURNAL_STREAM` names stderr's stream.
fn stderr_is_journal() -> bool {
    let Some(stream) = std::env::var_os("JOURNAL_STREAM") else {
        return false;
    };
    let Some((dev, ino)) = stream.to_str().and_then(parse_journal_stream) else {
        return false;
    };
    // SAFETY: `stat` is plain data for which all zeroes is a valid value; fstat fills it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat of fd 2 writes into `st`, a live stat; a closed fd is an error return.
    if unsafe { libc::fstat(std::io::stderr().as_raw_fd(), &mut st) } != 0 {
        return false;
    }
    st.st_dev == dev && st.st_ino == ino
}

/// `DEV:INO`, both decimal.
fn parse_journal_stream(s: &str) -> Option<(u64, u64)> {
    let (dev, ino) = s.split_once(':')?;
    Some((dev.parse().ok()?, ino.parse().ok()?))
}

/// The syslog priority prefix of a level.
fn priority(level: &Level) -> &'static str {
    match *level {
        Level::ERROR => "<3>",
        Level::WARN => "<4>",
        Level::INFO => "<6>",
        Level::DEBUG | Level::TRACE => "<7>",
    }
}

/// An event format with each line opened by its syslog priority.
struct SyslogPriority<F>(F);

impl<S, N, F> FormatEvent<S, N> for SyslogPriority<F>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        writer.write_str(priority(event.metadata().level()))?;
        self.0.format_event(ctx, writer, event)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_journal_stream_parses_dev_ino_refuses_malformed() {
        assert_eq!(parse_journal_stream("8:1234"), Some((8, 1234)));
        assert_eq!(parse_journal_stream("8"), None);
        assert_eq!(parse_journal_stream("8:x"), None);
        assert_eq!(parse_journal_stream(":1"), None);
        assert_eq!(priority(&Level::WARN), "<4>");
        assert_eq!(priority(&Level::TRACE), "<7>");
    }
}
