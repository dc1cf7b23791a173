//! TLS servers of the test's own: a CA made for the run and a certificate it signs
//! for `127.0.0.1` and `localhost`, a `redis-server` that speaks only TLS and asks for
//! a password, and a PostgreSQL server (Debian's binaries) that takes only TLS
//! connections with a SCRAM password. Each listens on a free loopback port, keeps its
//! files in a fresh temporary directory and is stopped when dropped.

use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};

/// A CA and a server certificate it signed, all PEM.
pub struct Pki {
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: String,
}

impl Pki {
    /// A fresh CA, and a certificate for `127.0.0.1` and `localhost` signed by it.
    pub fn new() -> Pki {
        let ca_key = KeyPair::generate().expect("CA key");
        let mut ca = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
        ca.distinguished_name
            .push(DnType::CommonName, format!("idempotent test CA {}", random_hex()));
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca_cert = ca.self_signed(&ca_key).expect("CA certificate");
        let issuer = Issuer::new(ca, ca_key);

        let key = KeyPair::generate().expect("server key");
        let mut server = CertificateParams::new(vec!["127.0.0.1".into(), "localhost".into()])
            .expect("server parameters");
        server.distinguished_name.push(DnType::CommonName, "localhost");
        let cert = server.signed_by(&key, &issuer).expect("server certificate");
        Pki { ca_pem: ca_cert.pem(), cert_pem: cert.pem(), key_pem: key.serialize_pem() }
    }

    /// Writes `ca.pem`, `server.pem` and `server.key` (mode 0600) into `dir`.
    fn write_to(&self, dir: &Path) {
        use std::os::unix::fs::PermissionsExt;
        std::fs::write(dir.join("ca.pem"), &self.ca_pem).unwrap();
        std::fs::write(dir.join("server.pem"), &self.cert_pem).unwrap();
        std::fs::write(dir.join("server.key"), &self.key_pem).unwrap();
        std::fs::set_permissions(dir.join("server.key"), std::fs::Permissions::from_mode(0o600))
            .unwrap();
    }
}

/// A password no other run uses: `s3cr3t-` and 16 hex digits.
pub fn secret() -> String {
    format!("s3cr3t-{}", random_hex())
}

/// 16 random hex digits.
pub fn random_hex() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos(),
    );
    format!("{:016x}", hasher.finish())
}

/// A loopback port nothing listens on (when this returns).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "idempotent-test-{name}-{}-{}",
        std::process::id(),
        random_hex()
    ));
    std::fs::create_dir_all(&dir).expect("create a temporary directory");
    dir
}

/// Whether `program` runs (with `arg`); outside CI a missing one skips the test, under
/// `CI` it fails it.
fn have(program: &Path, arg: &str) -> bool {
    let ok = Command::new(program).arg(arg).output().is_ok_and(|o| o.status.success());
    if !ok {
        assert!(std::env::var_os("CI").is_none(), "CI needs {}", program.display());
        eprintln!("skipped: {} is not installed", program.display());
    }
    ok
}

fn wait_for_port(port: u16, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "{what} on {port} did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A `redis-server` that listens only for TLS (`--port 0 --tls-port P`), with the
/// certificate of a [`Pki`], no client certificates asked, and a password.
pub struct TlsRedis {
    pub port: u16,
    pub password: String,
    dir: PathBuf,
    child: Child,
}

impl TlsRedis {
    /// Starts a server with `pki`'s certificate; `None` outside CI when `redis-server`
    /// is not installed.
    pub fn start(pki: &Pki) -> Option<TlsRedis> {
        if !have(Path::new("redis-server"), "--version") {
            return None;
        }
        let port = free_port();
        let dir = temp_dir(&format!("redis-tls-{port}"));
        pki.write_to(&dir);
        let password = secret();
        let path = |name: &str| dir.join(name).to_str().unwrap().to_owned();
        let child = Command::new("redis-server")
            .args(["--port", "0", "--tls-port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--tls-cert-file", &path("server.pem"), "--tls-key-file", &path("server.key")])
            .args(["--tls-ca-cert-file", &path("ca.pem"), "--tls-auth-clients", "no"])
            .args([
                "--requirepass",
                &password,
                "--dir",
                &path(""),
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server starts");
        let server = TlsRedis { port, password, dir, child };
        wait_for_port(port, "redis-server");
        Some(server)
    }

    /// `rediss://:<password>@<host>:<port>`.
    pub fn url(&self, host: &str) -> String {
        format!("rediss://:{}@{host}:{}", self.password, self.port)
    }
}

impl Drop for TlsRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A PostgreSQL server whose only way in over TCP is TLS with a SCRAM password
/// (`hostssl ... scram-sha-256`, no `host` line), for the user and database `app`.
/// The `postgres` superuser comes in through the Unix socket alone.
pub struct TlsPostgres {
    pub port: u16,
    pub password: String,
    dir: PathBuf,
    child: Option<Child>,
}

impl TlsPostgres {
    /// The user and database the server has for the tests.
    pub const USER: &str = "app";

    /// Starts a server with `pki`'s certificate and creates the `app` user (with a
    /// fresh password) and database; `None` outside CI when PostgreSQL's server is not
    /// installed.
    pub async fn start(pki: &Pki) -> Option<TlsPostgres> {
        let bin = postgres_bin();
        if !have(&bin.join("postgres"), "--version") {
            return None;
        }
        let port = free_port();
        let dir = temp_dir(&format!("postgres-tls-{port}"));
        pki.write_to(&dir);
        std::fs::create_dir_all(dir.join("socket")).unwrap();
        let as_root = Command::new("id").arg("-u").output().is_ok_and(|o| o.stdout == b"0\n");
        if as_root {
            let status = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&dir)
                .status()
                .expect("chown runs");
            assert!(status.success(), "chown the server's directory to postgres");
        }
        // initdb and postgres refuse to run as root.
        let command = |program: &str| {
            let path = bin.join(program);
            if as_root {
                let mut command = Command::new("runuser");
                command.args(["-u", "postgres", "--"]).arg(path);
                command
            } else {
                Command::new(path)
            }
        };
        let data = dir.join("data");
        let out = command("initdb")
            .arg("-D")
            .arg(&data)
            .args(["-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync"])
            .output()
            .expect("initdb runs");
        assert!(out.status.success(), "initdb failed: {}", String::from_utf8_lossy(&out.stderr));
        std::fs::write(
            data.join("pg_hba.conf"),
            "local all postgres trust\nhostssl app app 127.0.0.1/32 scram-sha-256\n",
        )
        .unwrap();
        let log = std::fs::File::create(dir.join("postgres.log")).unwrap();
        let path = |name: &str| dir.join(name).to_str().unwrap().to_owned();
        let child = command("postgres")
            .arg("-D")
            .arg(&data)
            .args(["-p", &port.to_string(), "-k", &path("socket")])
            .args(["-c", "listen_addresses=127.0.0.1", "-c", "ssl=on"])
            .args(["-c", &format!("ssl_cert_file={}", path("server.pem"))])
            .args(["-c", &format!("ssl_key_file={}", path("server.key"))])
            .args(["-c", "fsync=off", "-c", "password_encryption=scram-sha-256"])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("postgres starts");
        let server = TlsPostgres { port, password: secret(), dir, child: Some(child) };
        let admin = server.admin().await;
        for statement in [
            format!("CREATE ROLE app LOGIN PASSWORD '{}'", server.password),
            "CREATE DATABASE app OWNER app".to_owned(),
        ] {
            sqlx::query(sqlx::AssertSqlSafe(statement)).execute(&admin).await.unwrap();
        }
        admin.close().await;
        Some(server)
    }

    /// A connection as `postgres` through the Unix socket, once the server answers.
    async fn admin(&self) -> sqlx::PgPool {
        let options = sqlx::postgres::PgConnectOptions::new()
            .socket(self.dir.join("socket"))
            .port(self.port)
            .username("postgres")
            .database("postgres");
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(1)
                .acquire_timeout(Duration::from_secs(5))
                .connect_with(options.clone())
                .await;
            match pool {
                Ok(pool) => return pool,
                Err(e) => {
                    let log = std::fs::read_to_string(self.dir.join("postgres.log"));
                    assert!(
                        Instant::now() < deadline,
                        "PostgreSQL on {} did not start: {e}\n{}",
                        self.port,
                        log.unwrap_or_default()
                    );
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }

    /// The CA certificate's file, for `sslrootcert=`.
    pub fn ca_file(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }
}

impl Drop for TlsPostgres {
    fn drop(&mut self) {
        // The child may be `runuser`, which a signal to it would not pass on: stop the
        // postmaster itself (SIGQUIT: immediate shutdown), by the pid it wrote.
        let pid = std::fs::read_to_string(self.dir.join("data/postmaster.pid"))
            .ok()
            .and_then(|s| s.lines().next().map(str::to_owned));
        if let Some(pid) = pid {
            let _ = Command::new("kill").args(["-QUIT", &pid]).status();
        }
        if let Some(mut child) = self.child.take() {
            let deadline = Instant::now() + Duration::from_secs(10);
            while child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The newest `/usr/lib/postgresql/<version>/bin`.
fn postgres_bin() -> PathBuf {
    let newest = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .max();
    match newest {
        Some(version) => PathBuf::from(format!("/usr/lib/postgresql/{version}/bin")),
        None => PathBuf::from("/usr/lib/postgresql/bin"),
    }
}
