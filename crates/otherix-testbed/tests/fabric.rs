//! Worlds as networks: namespaces reach each other and the host over the fabric, and
//! parallel worlds never share a name or an address. Runs as root.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use otherix_testbed::{Error, World};

const PORT: u16 = 8000;
const BODY: &str = "hello from the b namespace\n";

#[test]
fn namespaces_on_one_fabric_reach_each_other_and_the_host_reaches_them() {
    let world = World::new("fabric reachability").unwrap();
    let a = world.add_namespace("a").unwrap();
    let b = world.add_namespace("b").unwrap();
    assert_eq!(a.name(), format!("{}-a", world.prefix()));
    let [n0, n1, n2, _] = world.subnet().octets();
    assert_eq!((n0, n1), (10, 213));
    assert_eq!(world.host_ip().octets(), [10, 213, n2, 1]);
    assert_eq!(a.ip().octets(), [10, 213, n2, 2]);
    assert_eq!(b.ip().octets(), [10, 213, n2, 3]);

    // b serves a file over HTTP on its fabric address.
    let www = world.dir().join("www");
    std::fs::create_dir(&www).unwrap();
    std::fs::write(www.join("hello.txt"), BODY).unwrap();
    let server = world
        .spawn(
            Some(&b),
            "python3",
            [
                "-u",
                "-m",
                "http.server",
                &PORT.to_string(),
                "--bind",
                &b.ip().to_string(),
                "--directory",
                www.to_str().unwrap(),
            ],
            &[],
        )
        .unwrap();
    server
        .wait_for_log("Serving HTTP", Duration::from_secs(20))
        .unwrap();

    // a → b across the bridge, with a real client.
    let url = format!("http://{}:{PORT}/hello.txt", b.ip());
    let body = world
        .exec_ok(&a, &["curl", "-sS", "--max-time", "10", &url])
        .unwrap();
    assert_eq!(body, BODY);

    // host → b through the host leg.
    let addr = SocketAddr::from((b.ip(), PORT));
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(10)).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    stream.write_all(b"GET /hello.txt HTTP/1.0\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    assert!(response.starts_with("HTTP/1.0 200"), "{response}");
    assert!(response.ends_with(BODY), "{response}");

    // The server saw one request from a's address and one from the host leg's.
    let log = server.log();
    assert!(log.contains(&format!("{} - - ", a.ip())), "{log}");
    assert!(log.contains(&format!("{} - - ", world.host_ip())), "{log}");
}

#[test]
fn namespaces_and_the_host_only_gain_the_connected_route() {
    let world = World::new("routes").unwrap();
    let node = world.add_namespace("node").unwrap();

    let routes = world.exec_ok(&node, &["ip", "-4", "route", "show"]).unwrap();
    assert_eq!(
        routes.trim(),
        format!(
            "{} dev eth0 proto kernel scope link src {}",
            world.subnet_cidr(),
            node.ip()
        )
    );

    let out = std::process::Command::new("ip")
        .args(["-4", "route", "show", "table", "all", "dev", &world.host_link()])
        .output()
        .unwrap();
    let host_routes = String::from_utf8(out.stdout).unwrap();
    let main: Vec<&str> = host_routes
        .lines()
        .filter(|l| !l.contains("table local"))
        .collect();
    assert_eq!(
        main,
        [format!(
            "{} proto kernel scope link src {} ",
            world.subnet_cidr(),
            world.host_ip()
        )]
    );

    let mtu = world.exec_ok(&node, &["cat", "/sys/class/net/eth0/mtu"]).unwrap();
    assert_eq!(mtu.trim(), "1500");
}

#[test]
fn parallel_worlds_get_different_prefixes_and_subnets() {
    let worlds: Vec<World> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|i| s.spawn(move || World::new(&format!("parallel {i}")).unwrap()))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });

    let mut prefixes: Vec<&str> = worlds.iter().map(World::prefix).collect();
    let mut subnets: Vec<_> = worlds.iter().map(World::subnet).collect();
    prefixes.sort();
    prefixes.dedup();
    subnets.sort();
    subnets.dedup();
    assert_eq!(prefixes.len(), 4, "{worlds:?}");
    assert_eq!(subnets.len(), 4, "{worlds:?}");

    for world in &worlds {
        assert!(
            world.prefix().starts_with("ox") && world.prefix().len() == 6,
            "{world:?}"
        );
        assert!(world.host_link().len() <= 15);
        let out = std::process::Command::new("ip")
            .args(["-4", "-o", "addr", "show", "dev", &world.host_link()])
            .output()
            .unwrap();
        let addr = String::from_utf8(out.stdout).unwrap();
        assert!(addr.contains(&format!("inet {}/24", world.host_ip())), "{addr}");
    }
}

#[test]
fn the_caller_cannot_reuse_a_role_or_reach_into_another_world() {
    let world = World::new("misuse").unwrap();
    let other = World::new("misuse, other world").unwrap();
    world.add_namespace("node").unwrap();
    let theirs = other.add_namespace("node").unwrap();

    assert!(matches!(
        world.add_namespace("node"),
        Err(Error::InvalidRole { .. })
    ));
    assert!(matches!(
        world.add_namespace("fab"),
        Err(Error::InvalidRole { .. })
    ));
    assert!(matches!(
        world.add_namespace("No/De"),
        Err(Error::InvalidRole { .. })
    ));
    assert!(matches!(
        world.exec(&theirs, &["true"]),
        Err(Error::ForeignNamespace { .. })
    ));
    assert!(matches!(
        world.spawn(Some(&theirs), "true", [""; 0], &[]),
        Err(Error::ForeignNamespace { .. })
    ));
    assert!(matches!(
        world.exec_netns("lo", &["true"]),
        Err(Error::ForeignNamespace { .. })
    ));
}
