//! The live view: a small HTTP server with one page that shows a scanout and refreshes it,
//! and the scanout itself as a PNG.
//!
//! # What it serves
//! `GET /` (or `HEAD`): an HTML page whose script fetches `/screen.png` again as soon as the
//! last one arrived and [`ViewConfig::interval`] passed, and shows it (or why there is no
//! picture). `GET /screen.png`: what the scanout shows now (200, `image/png`), or 503 with
//! the reason as text (the guest has not set a scanout yet, the instance is gone). Any
//! other path is 404, any other method 405. Every response closes its connection.
//!
//! # Bounds
//! - **Connections.** At most [`MAX_CONNECTIONS`] at once, each on a thread of its own;
//!   the next one gets a 503 (written with a 100 ms deadline) and is closed. A connection
//!   has [`REQUEST_TIMEOUT`] to send its request head (at most [`MAX_HEAD`] bytes: 431
//!   beyond) and [`RESPONSE_TIMEOUT`] to take the response; then it is cut off. So a slow
//!   or stalled viewer holds one slot for seconds, never the device or the other viewers.
//! - **The device.** Frames come from a [`FrameCache`]: one capture per
//!   gap ([`FrameCache::new`]) however many viewers ask, each capture the source's
//!   (the device's lock held only to copy the picture; the PNG encoded after it, on the
//!   asking connection's thread). Writing a frame to a slow viewer holds no lock.
//!
//! HTTP rather than VNC (RFB): any browser is the client, nothing to install, and the page
//! works over an SSH tunnel (`ssh -L`). Rust VNC servers exist (`rustvncserver`, on Tokio;
//! `rfb`, `rfb2`, early) but would bring an async runtime or an early crate into `umdev`
//! for a view that needs no input path yet. The request head is parsed by `httparse`; the
//! server around it is here because `tiny_http` (the small maintained server) spawns a
//! thread for every connection without a limit and has no read or write deadlines.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Connections served at once.
pub const MAX_CONNECTIONS: usize = 8;
/// The largest request head (request line and headers).
pub const MAX_HEAD: usize = 8 * 1024;
/// How long a connection has to send its request head.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a connection has to take its response.
pub const RESPONSE_TIMEOUT: Duration = Duration::from_secs(10);
/// The path of the picture.
pub const IMAGE_PATH: &str = "/screen.png";

/// A PNG of what the scanout shows now, or why there is none (said to the viewer).
pub type Frame = Result<Arc<Vec<u8>>, String>;

/// Where frames come from: the device (`umdev run --view`) or a control socket (`umdev
/// view`).
pub type FrameSource = Box<dyn Fn() -> Frame + Send + Sync>;

/// The last frame, shared by every viewer: a new capture only when the last is older than
/// the gap.
pub struct FrameCache {
    source: FrameSource,
    gap: Duration,
    last: Mutex<Option<(Instant, Frame)>>,
}

impl FrameCache {
    /// A cache of `source`, capturing at most once per `gap`.
    pub fn new(source: FrameSource, gap: Duration) -> FrameCache {
        FrameCache {
            source,
            gap,
            last: Mutex::new(None),
        }
    }

    /// The last frame if it is fresh, else a new one. Viewers that ask during a capture
    /// wait for it (and take it) instead of capturing again.
    pub fn frame(&self) -> Frame {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((at, frame)) = &*last {
            if at.elapsed() < self.gap {
                return frame.clone();
            }
        }
        let frame = (self.source)();
        *last = Some((Instant::now(), frame.clone()));
        frame
    }
}

/// How the view is served.
#[derive(Clone, Debug)]
pub struct ViewConfig {
    /// The address to listen on (port 0: any free port).
    pub listen: SocketAddr,
    /// What the page's title says (which device).
    pub title: String,
    /// How long the page waits after a picture before it asks for the next.
    pub interval: Duration,
}

/// A running view; it serves until the process ends.
pub struct View {
    addr: SocketAddr,
}

impl View {
    /// Bind `config.listen` and serve frames of `cache` on a thread of its own.
    pub fn spawn(config: ViewConfig, cache: Arc<FrameCache>) -> io::Result<View> {
        let listener = TcpListener::bind(config.listen)?;
        let addr = listener.local_addr()?;
        let page = Arc::new(page(&config.title, config.interval));
        std::thread::Builder::new()
            .name("umdev-view".into())
            .spawn(move || accept_loop(&listener, &page, &cache))?;
        Ok(View { addr })
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The page's URL.
    pub fn url(&self) -> String {
        format!("http://{}/", self.addr())
    }
}

/// Counts a connection in hand while it lives.
struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

fn accept_loop(listener: &TcpListener, page: &Arc<String>, cache: &Arc<FrameCache>) {
    let live = Arc::new(AtomicUsize::new(0));
    let mut failures = 0u32;
    for stream in listener.incoming() {
        let stream = match stream {
            Ok(s) => {
                failures = 0;
                s
            }
            Err(e) => {
                // EMFILE and the like: back off rather than spin (10 ms doubling to 1 s).
                failures = failures.saturating_add(1);
                if failures == 1 {
                    tracing::warn!(error = %e, "live view: accept failed");
                }
                std::thread::sleep(Duration::from_millis(10 << failures.min(7)));
                continue;
            }
        };
        if live.fetch_add(1, Ordering::AcqRel) >= MAX_CONNECTIONS {
            live.fetch_sub(1, Ordering::AcqRel);
            // What the peer sent already is taken (closing on unread bytes resets the
            // connection); the accept loop waits for nothing else.
            let _ = stream.set_nonblocking(true);
            let _ = (&stream).read(&mut [0u8; MAX_HEAD]);
            let _ = stream.set_nonblocking(false);
            let _ = stream.set_write_timeout(Some(Duration::from_millis(100)));
            let _ = respond(
                &stream,
                &Response::text(503, "busy: too many viewers; try again"),
                false,
            );
            continue;
        }
        let slot = Slot(live.clone());
        let (page, cache) = (page.clone(), cache.clone());
        let spawned = std::thread::Builder::new()
            .name("umdev-viewer".into())
            .spawn(move || {
                let _slot = slot;
                serve(&stream, &page, &cache);
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "live view: cannot spawn a connection thread");
        }
    }
}

/// A response: status, content type, body.
struct Response {
    status: u16,
    content_type: &'static str,
    body: Arc<Vec<u8>>,
    allow: bool,
}

impl Response {
    fn text(status: u16, text: &str) -> Response {
        Response {
            status,
            content_type: "text/plain; charset=utf-8",
            body: Arc::new(format!("{text}\n").into_bytes()),
            allow: status == 405,
        }
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        431 => "Request Header Fields Too Large",
        503 => "Service Unavailable",
        _ => "Error",
    }
}

/// Write `r` (its body unless `head_only`) and close.
fn respond(mut stream: &TcpStream, r: &Response, head_only: bool) -> io::Result<()> {
    let mut head = format!(
        "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nCache-Control: no-store\r\n\
         X-Content-Type-Options: nosniff\r\nConnection: close\r\n",
        r.status,
        reason(r.status),
        r.content_type,
        r.body.len()
    );
    if r.allow {
        head.push_str("Allow: GET, HEAD\r\n");
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes())?;
    if !head_only {
        stream.write_all(&r.body)?;
    }
    stream.flush()?;
    let _ = stream.shutdown(std::net::Shutdown::Write);
    Ok(())
}

/// After a response: take what the peer still sends for 200 ms at most.
fn linger(mut stream: &TcpStream) {
    // Take what the peer still sends (a body we did not read) for a moment: closing with
    // unread bytes would reset the connection and could lose the response on its way.
    let until = Instant::now() + Duration::from_millis(200);
    let mut sink = [0u8; 4096];
    loop {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() || stream.set_read_timeout(Some(left)).is_err() {
            break;
        }
        match stream.read(&mut sink) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
    }
}

/// What a request head asks for: the method and the path (query cut off), or the status
/// to refuse it with.
fn parse_head(buf: &[u8]) -> Result<Option<(String, String)>, u16> {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(buf) {
        Ok(httparse::Status::Complete(_)) => {
            let method = req.method.unwrap_or_default().to_owned();
            let target = req.path.unwrap_or_default();
            let path = target
                .split(['?', '#'])
                .next()
                .unwrap_or_default()
                .to_owned();
            Ok(Some((method, path)))
        }
        Ok(httparse::Status::Partial) if buf.len() >= MAX_HEAD => Err(431),
        Ok(httparse::Status::Partial) => Ok(None),
        Err(httparse::Error::TooManyHeaders) => Err(431),
        Err(_) => Err(400),
    }
}

/// Read the request head by `deadline`.
fn read_head(mut stream: &TcpStream, deadline: Instant) -> Result<(String, String), u16> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || stream.set_read_timeout(Some(left)).is_err() {
            return Err(408);
        }
        let room = (MAX_HEAD - buf.len()).min(chunk.len());
        let n = match stream.read(&mut chunk[..room]) {
            Ok(0) => return Err(400),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => return Err(408),
        };
        buf.extend_from_slice(&chunk[..n]);
        if let Some(head) = parse_head(&buf)? {
            return Ok(head);
        }
    }
}

/// Answer one request on `stream`.
fn serve(stream: &TcpStream, page: &Arc<String>, cache: &FrameCache) {
    let head = read_head(stream, Instant::now() + REQUEST_TIMEOUT);
    let _ = stream.set_write_timeout(Some(RESPONSE_TIMEOUT));
    let (method, path) = match head {
        Ok(h) => h,
        Err(408) => return, // a peer that sent nothing whole: nothing to answer
        Err(status) => {
            let _ = respond(stream, &Response::text(status, reason(status)), false);
            linger(stream);
            return;
        }
    };
    let head_only = method == "HEAD";
    let response = route(&method, &path, page, cache);
    tracing::debug!(%method, %path, status = response.status, "live view request");
    match respond(stream, &response, head_only) {
        Ok(()) => linger(stream),
        Err(e) => tracing::debug!(error = %e, "live view: a viewer went away (or was too slow)"),
    }
}

fn route(method: &str, path: &str, page: &Arc<String>, cache: &FrameCache) -> Response {
    if method != "GET" && method != "HEAD" {
        return Response::text(405, "only GET and HEAD");
    }
    match path {
        "/" | "/index.html" => Response {
            status: 200,
            content_type: "text/html; charset=utf-8",
            body: Arc::new(page.as_bytes().to_vec()),
            allow: false,
        },
        IMAGE_PATH => match cache.frame() {
            Ok(png) => Response {
                status: 200,
                content_type: "image/png",
                body: png,
                allow: false,
            },
            Err(why) => Response::text(503, &why),
        },
        _ => Response::text(404, "not found: the view is / and /screen.png"),
    }
}

/// `s` safe inside HTML text.
fn html_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// The page: the picture, refreshed `interval` after the last one arrived.
fn page(title: &str, interval: Duration) -> String {
    // A JSON string is a JS string; `<` escaped so that no `</script>` can end the script.
    let js_title = serde_json::to_string(title)
        .unwrap_or_else(|_| "\"\"".into())
        .replace('<', "\\u003c");
    let ms = interval.as_millis();
    let html_title = html_escape(title);
    format!(
        r#"<!doctype html>
<html><head><meta charset="utf-8"><title>umdev: {html_title}</title>
<style>body{{margin:0;background:#202020;color:#c8c8c8;font:13px sans-serif}}
#s{{padding:4px 8px}}img{{display:block;margin:0 auto;max-width:100%}}</style></head>
<body><div id="s">{html_title}</div><img id="i" alt="">
<script>
const title = {js_title}, img = document.getElementById("i"), status = document.getElementById("s");
function next() {{ setTimeout(load, {ms}); }}
function load() {{
  fetch("{IMAGE_PATH}", {{ cache: "no-store" }})
    .then(r => r.ok ? r.blob() : r.text().then(t => {{ throw new Error(t.trim()); }}))
    .then(b => {{
      const u = URL.createObjectURL(b);
      img.onload = () => URL.revokeObjectURL(u);
      img.src = u;
      status.textContent = title + " \u2014 " + new Date().toLocaleTimeString();
    }})
    .catch(e => {{ status.textContent = title + ": " + e.message; }})
    .finally(next);
}}
load();
</script>
<noscript><img src="{IMAGE_PATH}" alt="the scanout"> (reload to refresh)</noscript>
</body></html>
"#
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(addr: SocketAddr, request: &str) -> (String, Vec<u8>) {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(request.as_bytes()).unwrap();
        let mut all = Vec::new();
        s.read_to_end(&mut all).unwrap();
        let at = all.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
        let head = String::from_utf8(all[..at].to_vec()).unwrap();
        (head, all[at + 4..].to_vec())
    }

    fn view(source: FrameSource) -> (View, Arc<AtomicUsize>) {
        let calls = Arc::new(AtomicUsize::new(0));
        let counted = calls.clone();
        let cache = Arc::new(FrameCache::new(
            Box::new(move || {
                counted.fetch_add(1, Ordering::AcqRel);
                source()
            }),
            Duration::from_secs(60),
        ));
        let config = ViewConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            title: "t<x>".into(),
            interval: Duration::from_millis(200),
        };
        (View::spawn(config, cache).unwrap(), calls)
    }

    #[test]
    fn test_view_routes_image_page_404_405() {
        let (v, calls) = view(Box::new(|| Ok(Arc::new(b"\x89PNG-ish".to_vec()))));
        let (head, body) = get(v.addr(), "GET /screen.png?t=1 HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(head.starts_with("HTTP/1.1 200 OK"), "{head}");
        assert!(head.contains("Content-Type: image/png"), "{head}");
        assert_eq!(body, b"\x89PNG-ish");
        let (head, body) = get(v.addr(), "GET / HTTP/1.1\r\n\r\n");
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        let page = String::from_utf8(body).unwrap();
        assert!(
            page.contains(IMAGE_PATH) && page.contains("t&lt;x&gt;"),
            "{page}"
        );
        assert!(!page.contains("t<x>"), "the title is escaped: {page}");
        let (head, _) = get(v.addr(), "GET /etc/passwd HTTP/1.1\r\n\r\n");
        assert!(head.starts_with("HTTP/1.1 404"), "{head}");
        let (head, _) = get(v.addr(), "POST /screen.png HTTP/1.1\r\n\r\n");
        assert!(head.starts_with("HTTP/1.1 405"), "{head}");
        assert!(head.contains("Allow: GET, HEAD"), "{head}");
        let (head, body) = get(v.addr(), "HEAD /screen.png HTTP/1.1\r\n\r\n");
        assert!(head.contains("Content-Length: 8"), "{head}");
        assert!(body.is_empty());
        let (head, _) = get(v.addr(), "NOT HTTP\r\n\r\n");
        assert!(head.starts_with("HTTP/1.1 400"), "{head}");
        // Two image requests within the gap: one capture.
        assert_eq!(calls.load(Ordering::Acquire), 1);
    }

    #[test]
    fn test_view_without_picture_says_why_with_503() {
        let (v, _) = view(Box::new(|| Err("scanout 0 shows nothing yet".into())));
        let (head, body) = get(v.addr(), "GET /screen.png HTTP/1.1\r\n\r\n");
        assert!(head.starts_with("HTTP/1.1 503"), "{head}");
        assert_eq!(body, b"scanout 0 shows nothing yet\n");
    }

    #[test]
    fn test_view_stalled_viewers_leave_others_served_and_excess_refused() {
        let (v, _) = view(Box::new(|| Ok(Arc::new(vec![1, 2, 3]))));
        // MAX_CONNECTIONS viewers that connect and send nothing hold every slot...
        let stalled: Vec<TcpStream> = (0..MAX_CONNECTIONS)
            .map(|_| TcpStream::connect(v.addr()).unwrap())
            .collect();
        // A second for all of them to be accepted, even on a loaded host...
        std::thread::sleep(Duration::from_secs(1));
        // ...so the next one is refused at once, not queued behind them.
        // (A reset instead of the 503 is a refusal too: the request may arrive after it.)
        let t0 = Instant::now();
        let mut s = TcpStream::connect(v.addr()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let _ = s.write_all(b"GET /screen.png HTTP/1.1\r\n\r\n");
        let mut all = Vec::new();
        let _ = s.read_to_end(&mut all);
        let text = String::from_utf8_lossy(&all);
        assert!(all.is_empty() || text.starts_with("HTTP/1.1 503"), "{text}");
        assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
        // Once they are cut off (REQUEST_TIMEOUT), viewers are served again.
        std::thread::sleep(REQUEST_TIMEOUT + Duration::from_millis(500));
        let (head, body) = get(v.addr(), "GET /screen.png HTTP/1.1\r\n\r\n");
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        assert_eq!(body, [1, 2, 3]);
        drop(stalled);
    }

    #[test]
    fn test_parse_head_bounds_and_partial() {
        assert_eq!(parse_head(b"GET / HTTP/1.1\r\n"), Ok(None));
        assert_eq!(
            parse_head(b"GET /screen.png#x HTTP/1.1\r\n\r\n"),
            Ok(Some(("GET".into(), IMAGE_PATH.into())))
        );
        let long = format!("GET /{} HTTP/1.1\r\n", "a".repeat(MAX_HEAD));
        assert_eq!(parse_head(long.as_bytes()), Err(431));
    }
}
