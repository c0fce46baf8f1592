//! End-to-end tests of umdev's server driven by the independent `vfio_user::Client`.

mod common;

use common::test_device::*;
use common::TestServer;
use vfio_user::Client;

#[test]
fn test_client_connect_negotiates_and_reads_device_info() {
    let ts = TestServer::start();
    let client = Client::new(&ts.path).expect("connect");
    let bar0 = client.region(0).expect("region 0");
    assert_eq!(bar0.size, BAR0_SIZE);
    let cfg = client.region(7).expect("config region");
    assert_eq!(cfg.size, 256);
    assert!(client.region(8).is_some(), "9 regions reported");
}

#[test]
fn test_client_region_read_write_roundtrip() {
    let ts = TestServer::start();
    let mut client = Client::new(&ts.path).unwrap();
    client.region_write(0, 0x40, &[1, 2, 3, 4]).unwrap();
    let mut buf = [0u8; 4];
    client.region_read(0, 0x40, &mut buf).unwrap();
    assert_eq!(buf, [1, 2, 3, 4]);
    assert_eq!(&ts.state().regs[0x40..0x44], &[1, 2, 3, 4]);
    let mut cfg = [0u8; 2];
    client.region_read(7, 0x10, &mut cfg).unwrap();
    assert_eq!(cfg, [0x10, 0x11]);
}
