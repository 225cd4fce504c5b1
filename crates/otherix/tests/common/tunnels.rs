//! Helpers of the end-to-end tests that drive tunnels: one shared runtime,
//! an echo through a tunnel, reading until a tunnel fails, `otherix
//! connect` as a child process, and what an `otherix forward` logged.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use sha2::Digest;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The tests' runtime: two workers, like the machine.
pub fn rt() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
    })
}

/// Sends `line` through an echo tunnel and expects it back (20 s at most).
pub fn echo_through<T: AsyncRead + AsyncWrite + Unpin>(t: &mut T, line: &[u8]) {
    rt().block_on(async {
        t.write_all(line).await.unwrap();
        t.flush().await.unwrap();
        let mut back = vec![0u8; line.len()];
        tokio::time::timeout(Duration::from_secs(20), t.read_exact(&mut back))
            .await
            .expect("echo within 20 s")
            .unwrap();
        assert_eq!(back, line);
    });
}

/// Reads until the tunnel fails: its error, and how long that took. A
/// clean end of stream, or 30 s without either, fails the test.
pub fn read_until_error<T: AsyncRead + Unpin>(t: &mut T) -> (std::io::Error, Duration) {
    let started = Instant::now();
    rt().block_on(async {
        let mut buf = [0u8; 1024];
        loop {
            match tokio::time::timeout(Duration::from_secs(30), t.read(&mut buf)).await {
                Err(_) => panic!("the tunnel hung for 30 s instead of failing"),
                Ok(Ok(0)) => panic!("a clean end of stream, not an error"),
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return (e, started.elapsed()),
            }
        }
    })
}

/// `otherix connect VM PORT` with the client config `config`, with pipes;
/// an echo line proves it is open.
pub fn connect_process(config: &Path, vm: &str, port: u16) -> Child {
    let mut child = Command::new(super::BIN)
        .args(["connect", vm, &port.to_string()])
        .env("OTHERIX_CONFIG", config)
        .env_remove("RUST_LOG")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.as_mut().unwrap().write_all(b"hello\n").unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line, "hello\n");
    child
}

/// The forward's "connection forwarded" log lines (`ready=true|false`).
pub fn forwarded(fwd: &otherix_testbed::Proc) -> Vec<String> {
    fwd.log()
        .lines()
        .filter(|l| l.contains("connection forwarded"))
        .map(str::to_string)
        .collect()
}

/// Waits until `fwd` has made `n` connections ready.
pub fn wait_made_ready(fwd: &otherix_testbed::Proc, n: usize) {
    otherix_testbed::wait_until(
        &format!("{n} connections made ready"),
        Duration::from_secs(60),
        || (fwd.log().matches("connection made ready").count() >= n).then_some(()),
    )
    .unwrap();
}

/// The chunks a stamped stream is written and read in.
const CHUNK: usize = 1 << 20;

/// Writes `len` bytes of a random block, each chunk stamped with its number
/// (so a lost, repeated or reordered chunk changes the hash), then
/// half-closes: the echo still owes everything in flight. `before(sent)`
/// runs before each chunk. The hex SHA-256 of what was written.
pub fn send_stamped(mut writer: std::net::TcpStream, len: u64, mut before: impl FnMut(u64)) -> String {
    let mut block = vec![0u8; CHUNK];
    std::fs::File::open("/dev/urandom")
        .unwrap()
        .read_exact(&mut block)
        .unwrap();
    let mut hash = sha2::Sha256::new();
    let (mut left, mut n) = (len, 0u64);
    while left > 0 {
        before(len - left);
        block[..8].copy_from_slice(&n.to_le_bytes());
        let take = left.min(CHUNK as u64) as usize;
        writer.write_all(&block[..take]).unwrap();
        hash.update(&block[..take]);
        left -= take as u64;
        n += 1;
    }
    writer.shutdown(std::net::Shutdown::Write).unwrap();
    hex::encode(hash.finalize())
}

/// Reads `reader` to its end (each read within `timeout`), telling
/// `progress` the bytes so far: the hex SHA-256 and the length.
pub fn read_hashed(
    mut reader: std::net::TcpStream,
    timeout: Duration,
    mut progress: impl FnMut(u64),
) -> (String, u64) {
    reader.set_read_timeout(Some(timeout)).unwrap();
    let mut hash = sha2::Sha256::new();
    let mut buf = vec![0u8; CHUNK];
    let mut got = 0u64;
    loop {
        let n = reader.read(&mut buf).expect("the stream goes on");
        if n == 0 {
            break;
        }
        hash.update(&buf[..n]);
        got += n as u64;
        progress(got);
    }
    (hex::encode(hash.finalize()), got)
}

/// Sends `len` bytes through `addr` (an echo) while reading them back; returns
/// (sent hash, received hash, received length).
pub fn echo_stream(addr: std::net::SocketAddr, len: u64) -> (String, String, u64) {
    let conn = std::net::TcpStream::connect(addr).unwrap();
    conn.set_nodelay(true).unwrap();
    let writer = conn.try_clone().unwrap();
    let sender = std::thread::spawn(move || send_stamped(writer, len, |_| {}));
    let (received, got) = read_hashed(conn, Duration::from_secs(60), |_| {});
    (sender.join().unwrap(), received, got)
}
