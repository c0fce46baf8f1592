//! The `umdev` command line.
fn main() {
    eprintln!("umdev: being written");
    std::process::exit(2);
}
