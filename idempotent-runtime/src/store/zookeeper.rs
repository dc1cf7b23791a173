//! [`ZooKeeperStore`]: idempotency records as znodes on a ZooKeeper ensemble.
//!
//! Each key is a TTL znode `{root}/{bucket}/{key in hex}` (the bucket, a container
//! znode, is the first byte of the key's SHA-256, so no node has more than a 256th of
//! the records as children) whose data is the record:
//! `"<state><token> <lease ms> <keep ms> <attempts> <fingerprint> <result>"`, with
//! state `P` (in progress), `R` (released), `D` (done) or `F` (failed), the claim's
//! 32 hex digits or `-`, the fingerprint's 64 hex digits or `-`, and the cached result
//! (possibly empty) after the fifth space. Times are relative to the znode's `mtime`,
//! the time the ensemble's leader wrote it: the record exists while the leader's
//! clock is before `mtime + keep`, and a claim's lease runs while it is before
//! `mtime + lease`.
//!
//! An in-progress record has an ephemeral child named after the claim's token, created in the same
//! transaction (`multi`) as the record and owned by the claiming client's session.
//! A claim holds while its lease runs *and* its child exists: when the claiming
//! process dies, its session expires and ZooKeeper deletes the child, so another
//! consumer takes the key over after the session timeout even if the lease is longer.
//! A consumer whose session expired (a long pause, a partition) while it still runs
//! the handler takes its claim back at its next renewal, unless another consumer
//! took the key over meanwhile: then the renewal answers `LeaseLost`.
//!
//! A released, done or failed record has a child too, its keeper: a TTL znode named
//! `k` and the claim's token, made in the write that ends the claim, so that
//! ZooKeeper's reaper never deletes a record's znode under a record that is still
//! kept (see `keeper` in the source: the reaper deletes znodes it listed earlier,
//! checking only that they have no children).
//!
//! Every transition is conditional on the znode's version, read just before, so a
//! concurrent write makes it read again and decide anew; none overwrites another
//! consumer's record. Expired records are deleted by ZooKeeper itself (TTL nodes: the
//! server must run with `zookeeper.extendedTypesEnabled=true`), some time after they
//! expire; until then they are treated as absent.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use sha2::{Digest, Sha256};
use zookeeper_client as zk;

use super::{admin, format};
use crate::{Claim, Fingerprint, Key, Store, StoreError, Token, Transition, claim_retention};

/// The parent of every record unless configured.
pub const DEFAULT_ROOT: &str = "/idempotent";
/// The session timeout asked of the ensemble unless configured: a dead consumer's
/// claims are taken over this long after its last heartbeat, whatever their lease.
pub const DEFAULT_SESSION_TIMEOUT: Duration = Duration::from_secs(10);

/// How many times a transition reads and writes again after another write came
/// between its read and its write.
const RACES: usize = 32;

/// A [`Store`] on ZooKeeper 3.5 or later. See the [module documentation](self) for
/// how records map onto znodes.
///
/// ```no_run
/// # async fn demo() -> Result<(), idempotent_runtime::StoreError> {
/// use idempotent_runtime::zookeeper_store::ZooKeeperStore;
///
/// let store = ZooKeeperStore::connect("127.0.0.1:2181").await?;
/// # let _ = store; Ok(()) }
/// ```
#[derive(Clone)]
pub struct ZooKeeperStore {
    inner: Arc<Inner>,
}

struct Inner {
    hosts: String,
    root: String,
    session_timeout: Duration,
    /// The session timeout the ensemble granted (it bounds what a client asks for),
    /// in milliseconds: how long a claim's ephemeral child outlives the last packet
    /// the ensemble heard from its session.
    granted_timeout_ms: std::sync::atomic::AtomicU64,
    /// `user:password` for the `digest` scheme, sent on every new session.
    digest: Option<String>,
    /// The ACL of every znode the store creates: `creator_all` with credentials.
    acls: zk::Acls<'static>,
    /// The session in use; replaced by a new one once it expires.
    client: tokio::sync::Mutex<Option<zk::Client>>,
    /// The leader's clock, as last seen in a write's `mtime`.
    clock: parking_lot::Mutex<Option<(i64, Instant)>>,
}

/// How to connect a [`ZooKeeperStore`]: from [`ZooKeeperStore::builder`].
#[derive(Clone)]
#[must_use = "options do nothing until `connect` is awaited"]
pub struct ZooKeeperOptions {
    hosts: String,
    root: String,
    session_timeout: Duration,
    /// `user:password`, for the `digest` scheme.
    digest: Option<String>,
}

impl std::fmt::Debug for ZooKeeperOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZooKeeperOptions")
            .field("hosts", &without_credentials(&self.hosts))
            .field("root", &self.root)
            .field("session_timeout", &self.session_timeout)
            .field("digest", &self.digest.as_ref().map(|_| "<credentials>"))
            .finish()
    }
}

impl ZooKeeperOptions {
    /// Keeps records under `root`, an absolute path created if missing (default
    /// [`DEFAULT_ROOT`]). Give each application a root of its own.
    pub fn root(mut self, root: &str) -> Self {
        root.clone_into(&mut self.root);
        self
    }

    /// The session timeout asked of the ensemble (default [`DEFAULT_SESSION_TIMEOUT`];
    /// the ensemble bounds it to between 2 and 20 ticks): a dead consumer's claims are
    /// taken over this long after its last heartbeat.
    pub fn session_timeout(mut self, timeout: Duration) -> Self {
        self.session_timeout = timeout;
        self
    }

    /// Authenticates every session as `user` with `password` (ZooKeeper's `digest`
    /// scheme), and creates the root, its buckets and every record readable and
    /// writable by that identity only (the `creator_all` ACL: `digest:user:hash`).
    /// Without credentials, znodes are created open to anyone (`world:anyone`), so
    /// any client of the ensemble can read or change records: use credentials on an
    /// ensemble other applications share.
    ///
    /// ZooKeeper does not refuse a wrong password (a digest identity is whatever the
    /// password hashes to); the ACLs do. [`connect`](Self::connect) therefore checks
    /// that the session may create, read, write and delete under the root, and fails
    /// with [`StoreError::Misconfigured`] when the root belongs to another identity.
    pub fn digest(mut self, user: &str, password: &str) -> Self {
        self.digest = Some(format!("{user}:{password}"));
        self
    }

    /// Connects: reaches the ensemble, creates the root if missing, and checks that
    /// the server allows TTL nodes and that this session may create, read, write and
    /// delete znodes under the root. Each refusal is an error that says what to change.
    pub async fn connect(self) -> Result<ZooKeeperStore, StoreError> {
        let root = self.root;
        if !root.starts_with('/') || root.len() < 2 || root.ends_with('/') {
            return Err(StoreError::unavailable(format!(
                "the ZooKeeper root must be an absolute path such as `/idempotent`, not `{root}`"
            )));
        }
        if let Some(digest) = &self.digest {
            if digest.starts_with(':') {
                return Err(StoreError::Misconfigured(
                    "the ZooKeeper digest user is empty: pass the user's name to `digest`".into(),
                ));
            }
        }
        let acls =
            if self.digest.is_some() { zk::Acls::creator_all() } else { zk::Acls::anyone_all() };
        let store = ZooKeeperStore {
            inner: Arc::new(Inner {
                hosts: self.hosts,
                root,
                session_timeout: self.session_timeout,
                granted_timeout_ms: u64::try_from(millis(self.session_timeout)).unwrap_or(0).into(),
                digest: self.digest,
                acls,
                client: tokio::sync::Mutex::new(None),
                clock: parking_lot::Mutex::new(None),
            }),
        };
        let client = store.client().await?;
        store.check_root(&client).await?;
        Ok(store)
    }
}

impl ZooKeeperStore {
    /// Connects to the ensemble at `hosts` (`"host:port,host:port"`), keeping records
    /// under [`DEFAULT_ROOT`], with a [`DEFAULT_SESSION_TIMEOUT`] session.
    pub async fn connect(hosts: &str) -> Result<ZooKeeperStore, StoreError> {
        ZooKeeperStore::builder(hosts).connect().await
    }

    /// Connects to the ensemble at `hosts`, keeping records under `root` (an absolute
    /// path, created if missing), with sessions of `session_timeout` (the ensemble
    /// bounds it to between 2 and 20 ticks). Fails if the ensemble can't be reached or
    /// refuses TTL nodes. [`ZooKeeperStore::builder`] also takes credentials.
    pub async fn connect_with(
        hosts: &str,
        root: &str,
        session_timeout: Duration,
    ) -> Result<ZooKeeperStore, StoreError> {
        ZooKeeperStore::builder(hosts).root(root).session_timeout(session_timeout).connect().await
    }

    /// Options for a store on the ensemble at `hosts` (`"host:port,host:port"`): its
    /// root, session timeout and credentials, then [`connect`](ZooKeeperOptions::connect).
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), idempotent_runtime::StoreError> {
    /// use std::time::Duration;
    /// use idempotent_runtime::zookeeper_store::ZooKeeperStore;
    ///
    /// let store = ZooKeeperStore::builder("zk1:2181,zk2:2181,zk3:2181")
    ///     .root("/orders/idempotent")
    ///     .session_timeout(Duration::from_secs(6))
    ///     .digest("orders", &std::env::var("ZK_PASSWORD").unwrap_or_default())
    ///     .connect()
    ///     .await?;
    /// # let _ = store; Ok(()) }
    /// ```
    pub fn builder(hosts: &str) -> ZooKeeperOptions {
        ZooKeeperOptions {
            hosts: hosts.to_owned(),
            root: DEFAULT_ROOT.to_owned(),
            session_timeout: DEFAULT_SESSION_TIMEOUT,
            digest: None,
        }
    }

    /// The current session, or a new one when there is none or it expired.
    async fn client(&self) -> Result<zk::Client, StoreError> {
        let mut held = self.inner.client.lock().await;
        if let Some(client) = held.as_ref() {
            if !matches!(
                client.state(),
                zk::SessionState::Expired | zk::SessionState::Closed | zk::SessionState::AuthFailed
            ) {
                return Ok(client.clone());
            }
        }
        let mut connector = zk::Client::connector();
        connector = connector
            .with_session_timeout(self.inner.session_timeout)
            .with_connection_timeout(Duration::from_secs(5));
        if let Some(digest) = &self.inner.digest {
            connector = connector.with_auth("digest", digest.as_bytes());
        }
        let client = connector.connect(&self.inner.hosts).await.map_err(|e| {
            StoreError::unavailable(format!(
                "ZooKeeper at {}: {e}",
                without_credentials(&self.inner.hosts)
            ))
        })?;
        make_path(&client, &self.inner.root, self.inner.acls)
            .await
            .map_err(|e| self.refused("create", e))?;
        let granted = client.session_timeout().min(self.inner.session_timeout);
        self.inner.granted_timeout_ms.store(
            u64::try_from(millis(granted)).unwrap_or(0),
            std::sync::atomic::Ordering::Relaxed,
        );
        *held = Some(client.clone());
        Ok(client)
    }

    /// Checks what every transition needs of the ensemble: TTL nodes (refused unless
    /// the server enables extended types) and, for this session, create, read and
    /// delete under the root and write on the root (the clock reading writes it).
    async fn check_root(&self, client: &zk::Client) -> Result<(), StoreError> {
        let root = &self.inner.root;
        let refused = |needed: &str, error: zk::Error| self.refused(needed, error);
        let path = format!("{root}/ttl-check-{}", Token::random());
        let options = persistent(self.inner.acls).with_ttl(Duration::from_secs(1));
        match client.create(&path, b"", &options).await {
            Ok((stat, _)) => self.observe(&stat),
            Err(zk::Error::Unimplemented | zk::Error::BadArguments(_)) => {
                return Err(StoreError::Rejected(
                    "ZooKeeper refuses TTL nodes: start the server with \
                     -Dzookeeper.extendedTypesEnabled=true"
                        .into(),
                ));
            }
            Err(e) => return Err(refused("create znodes under", e)),
        }
        let checked = async {
            client.get_data(&path).await.map_err(|e| refused("read znodes under", e))?;
            client.list_children(root).await.map_err(|e| refused("list", e))?;
            self.fresh_now(client).await.map_err(|e| match e {
                StoreError::Misconfigured(_) => refused("write", zk::Error::NoAuth),
                other => other,
            })
        }
        .await;
        let deleted = client.delete(&path, None).await;
        checked?;
        deleted.map_err(|e| refused("delete znodes under", e))
    }

    /// `error` from a step that needed permission to `needed` the root: an ACL
    /// that refuses this session is a misconfiguration that names the identity
    /// (never the password) and what to do; anything else is [`zk_error`]'s.
    fn refused(&self, needed: &str, error: zk::Error) -> StoreError {
        let root = &self.inner.root;
        match error {
            zk::Error::NoAuth | zk::Error::InvalidAcl => {
                let who = match &self.inner.digest {
                    Some(digest) => {
                        let user = digest.split(':').next().unwrap_or_default();
                        format!("the digest identity `{user}`")
                    }
                    None => "a session without credentials".to_owned(),
                };
                StoreError::Misconfigured(format!(
                    "ZooKeeper refused {who} permission to {needed} the records' root `{root}` \
                     ({error}): its ACL grants that to another identity. Connect with the \
                     credentials it was created with (`ZooKeeperStore::builder(..).digest(..)`, \
                     and check the password: a wrong one is another identity), choose another \
                     root, or have an administrator grant this identity `cdrwa` on `{root}` \
                     (`setAcl -R`)"
                ))
            }
            other => zk_error(other),
        }
    }

    /// Notes the leader's clock from a write's `mtime`.
    fn observe(&self, stat: &zk::Stat) {
        if !stat.is_invalid() && stat.mtime > 0 {
            *self.inner.clock.lock() = Some((stat.mtime, Instant::now()));
        }
    }

    /// The leader's clock now, in ms: the last write's `mtime` plus the time since
    /// its answer came back, which is never ahead of the leader (the write happened
    /// before its answer). Without one yet, a write to the root tells.
    async fn now(&self, client: &zk::Client) -> Result<i64, StoreError> {
        if let Some((mtime, at)) = *self.inner.clock.lock() {
            return Ok(mtime.saturating_add(at.elapsed().as_millis() as i64));
        }
        self.fresh_now(client).await
    }

    /// The leader's clock now, from a write made for the purpose (to the root): for a
    /// decision that must not rest on an old reading.
    async fn fresh_now(&self, client: &zk::Client) -> Result<i64, StoreError> {
        let stat = client.set_data(&self.inner.root, b"", None).await.map_err(zk_error)?;
        self.observe(&stat);
        Ok(stat.mtime)
    }

    /// The record's path and its bucket's.
    fn paths(&self, key: &Key) -> (String, String) {
        self.paths_of(&key.stored())
    }

    /// The path of the record stored under `stored` ([`Key::stored`]) and its bucket's.
    fn paths_of(&self, stored: &[u8]) -> (String, String) {
        let bucket = format!("{}/{:02x}", self.inner.root, Sha256::digest(stored)[0]);
        let mut path = String::with_capacity(bucket.len() + 1 + 2 * stored.len());
        path.push_str(&bucket);
        path.push('/');
        for byte in stored {
            let _ = write!(path, "{byte:02x}");
        }
        (path, bucket)
    }

    /// Reads the record: `None` when there is none, or it expired.
    async fn read(
        &self,
        client: &zk::Client,
        path: &str,
    ) -> Result<Option<(Record, zk::Stat, i64)>, StoreError> {
        let (data, stat) = match client.get_data(path).await {
            Ok(found) => found,
            Err(zk::Error::NoNode) => return Ok(None),
            Err(e) => return Err(zk_error(e)),
        };
        let record = Record::parse(&data).ok_or_else(|| match format::newer(&data) {
            Some(what) => StoreError::NewerFormat(what),
            None => StoreError::Rejected("unreadable record: written by another program".into()),
        })?;
        let now = self.now(client).await?;
        Ok(Some((record, stat, now)))
    }

    async fn claim_with(
        &self,
        client: &zk::Client,
        key: &Key,
        token: Token,
        lease: Duration,
        ttl: Duration,
        fingerprint: Option<&Fingerprint>,
    ) -> Result<Claim, StoreError> {
        let (path, bucket) = self.paths(key);
        let keep = millis(claim_retention(lease, ttl));
        let lease = millis(lease);
        let mine = fingerprint.map(Fingerprint::to_string);
        for _ in 0..RACES {
            let Some((record, stat, now)) = self.read(client, &path).await? else {
                // No record, or an expired one: take the key afresh.
                let fresh = Record::claimed(token, lease, keep, 1, mine.clone());
                match self.take(client, &path, None, &fresh).await {
                    Ok(fence) => return Ok(Claim::Won { token, attempt: 1, fence: Some(fence) }),
                    Err(Taken::Raced) => continue,
                    Err(Taken::NoBucket) => {
                        match client.create(&bucket, b"", &container(self.inner.acls)).await {
                            Ok(_) | Err(zk::Error::NodeExists) => continue,
                            Err(e) => return Err(zk_error(e)),
                        }
                    }
                    Err(Taken::Failed(e)) => return Err(e),
                }
            };
            let expired = now >= stat.mtime.saturating_add(record.keep);
            if expired {
                let fresh = Record::claimed(token, lease, keep, 1, mine.clone());
                match self.take(client, &path, Some((&stat, &record)), &fresh).await {
                    Ok(fence) => return Ok(Claim::Won { token, attempt: 1, fence: Some(fence) }),
                    Err(Taken::Raced | Taken::NoBucket) => continue,
                    Err(Taken::Failed(e)) => return Err(e),
                }
            }
            if record.state == b'P' && record.token == Some(token) {
                // This claim's own write, whose answer was lost and is sent again: its
                // fence is that write's zxid (nothing else wrote the znode since).
                return Ok(Claim::Won {
                    token,
                    attempt: record.attempts,
                    fence: Some(zxid(stat.mzxid)),
                });
            }
            if let (Some(held), Some(given)) = (&record.fingerprint, &mine) {
                if held != given {
                    return Ok(Claim::Mismatch);
                }
            }
            match record.state {
                b'D' if record.result.is_empty() => return Ok(Claim::Done),
                b'D' => return Ok(Claim::Cached(record.result)),
                b'F' => return Ok(Claim::Failed { attempts: record.attempts }),
                _ => {}
            }
            let lease_until = stat.mtime.saturating_add(record.lease);
            if record.state == b'P' && now < lease_until && stat.num_children > 0 {
                let left = Duration::from_millis((lease_until - now) as u64);
                return Ok(Claim::InProgress { lease_left: Some(left) });
            }
            // Released, or in progress under a lapsed lease or a dead session.
            let attempt = record.attempts.saturating_add(1);
            let keep = keep.max(stat.mtime.saturating_add(record.keep) - now);
            let fingerprint = record.fingerprint.clone().or(mine.clone());
            let taken = Record::claimed(token, lease, keep, attempt, fingerprint);
            match self.take(client, &path, Some((&stat, &record)), &taken).await {
                Ok(fence) => return Ok(Claim::Won { token, attempt, fence: Some(fence) }),
                Err(Taken::Raced | Taken::NoBucket) => continue,
                Err(Taken::Failed(e)) => return Err(e),
            }
        }
        Err(StoreError::Protocol(format!("claim of {} raced {RACES} times", key.logged())))
    }

    /// Writes `record` as a claim: in one transaction, replaces the record seen
    /// (`seen`: its znode's stat and its content), or creates it, and gives it its
    /// ephemeral child.
    ///
    /// The transaction fails if anything changed since the read: the znode's version
    /// is checked, and the earlier claim's child is deleted by name (its token), so a
    /// znode deleted and created again since (back at version 0) does not pass for
    /// the one that was read: its child has another name, and a znode with a child
    /// can't be deleted.
    ///
    /// Answers the transaction's zxid, the claim's fence: ZooKeeper orders every
    /// write of the ensemble by zxid (a new leader's epoch is its high half), and a
    /// later claim of the key is a later write.
    async fn take(
        &self,
        client: &zk::Client,
        path: &str,
        seen: Option<(&zk::Stat, &Record)>,
        record: &Record,
    ) -> Result<u64, Taken> {
        let data = record.encode();
        let acls = self.inner.acls;
        let mut writer = client.new_multi_writer();
        let staged = (|| {
            match seen {
                Some((stat, earlier)) => {
                    if stat.num_children > 0 {
                        writer.add_delete(&child_path(path, earlier), None)?;
                    }
                    stage_write(&mut writer, path, stat, &data, record.keep, acls)?;
                }
                None => writer.add_create(path, &data, &ttl_node(record.keep, acls))?,
            }
            writer.add_create(
                &child_path(path, record),
                record.token_text().as_bytes(),
                &ephemeral(acls),
            )
        })();
        staged.map_err(|e| Taken::Failed(zk_error(e)))?;
        match writer.commit().await {
            Ok(results) => {
                self.observe_results(&results);
                let written = results.iter().find_map(|result| match result {
                    zk::MultiWriteResult::Create { stat, .. }
                    | zk::MultiWriteResult::SetData { stat }
                        if !stat.is_invalid() =>
                    {
                        Some(zxid(stat.mzxid))
                    }
                    _ => None,
                });
                // Every claim's transaction creates the claim's child.
                written.ok_or_else(|| {
                    Taken::Failed(StoreError::Protocol("a claim's write gave no zxid".into()))
                })
            }
            Err(zk::MultiWriteError::OperationFailed { source, index }) => match source {
                zk::Error::NodeExists | zk::Error::BadVersion | zk::Error::NotEmpty => {
                    Err(Taken::Raced)
                }
                // The bucket is missing (creating the record), or the record or its
                // child went away since it was read.
                zk::Error::NoNode if seen.is_none() && index == 0 => Err(Taken::NoBucket),
                zk::Error::NoNode => Err(Taken::Raced),
                other => Err(Taken::Failed(zk_error(other))),
            },
            Err(zk::MultiWriteError::RequestFailed { source }) => {
                Err(Taken::Failed(zk_error(source)))
            }
        }
    }

    fn observe_results(&self, results: &[zk::MultiWriteResult]) {
        for result in results {
            if let zk::MultiWriteResult::SetData { stat }
            | zk::MultiWriteResult::Create { stat, .. } = result
            {
                self.observe(stat);
            }
        }
    }

    /// A token-checked transition: `change` makes the new record from the claim's,
    /// or says the transition was already applied (its answer was lost and it is sent
    /// again); `keep_child` keeps (or makes) the ephemeral child, for a renewal.
    async fn transition(
        &self,
        key: &Key,
        keep_child: bool,
        change: impl Fn(&Record, &zk::Stat, i64) -> Change,
    ) -> Result<Transition, StoreError> {
        let client = self.client().await?;
        let (path, _) = self.paths(key);
        for _ in 0..RACES {
            let read = match self.read(&client, &path).await {
                // A later version's record is not this claim's (`format`).
                Err(StoreError::NewerFormat(_)) => return Ok(Transition::LeaseLost),
                read => read?,
            };
            let Some((record, stat, now)) = read else { return Ok(Transition::LeaseLost) };
            if now >= stat.mtime.saturating_add(record.keep) {
                return Ok(Transition::LeaseLost);
            }
            let next = match change(&record, &stat, now) {
                Change::To(next) => next,
                Change::Done => return Ok(Transition::Applied),
                Change::Lost => return Ok(Transition::LeaseLost),
            };
            let child = child_path(&path, &record);
            // A znode replaced for a longer TTL comes without the child.
            let replaced = node_ttl(stat.ephemeral_owner) < node_ttl_for(next.keep);
            let had_child = stat.num_children > 0;
            let acls = self.inner.acls;
            let mut writer = client.new_multi_writer();
            let staged = (|| {
                if had_child && (replaced || !keep_child) {
                    writer.add_delete(&child, None)?;
                }
                stage_write(&mut writer, &path, &stat, &next.encode(), next.keep, acls)?;
                if keep_child && (replaced || !had_child) {
                    writer.add_create(&child, record.token_text().as_bytes(), &ephemeral(acls))?;
                }
                if !keep_child {
                    // The claim's child gives way to the keeper, in the same write:
                    // the record is never without a child (see `keeper`).
                    writer.add_create(&child_path(&path, &next), b"", &keeper(next.keep, acls))?;
                }
                Ok(())
            })();
            staged.map_err(zk_error)?;
            match writer.commit().await {
                Ok(results) => {
                    self.observe_results(&results);
                    return Ok(Transition::Applied);
                }
                Err(zk::MultiWriteError::OperationFailed {
                    source:
                        zk::Error::BadVersion
                        | zk::Error::NoNode
                        | zk::Error::NodeExists
                        | zk::Error::NotEmpty,
                    ..
                }) => continue,
                Err(e) => return Err(zk_error(e.into())),
            }
        }
        Err(StoreError::Protocol(format!("transition of {} raced {RACES} times", key.logged())))
    }

    /// Releases `token`'s claim in the background, taking its attempt back: for a
    /// claim whose answer was lost, under which no handler ran.
    fn give_back_in_background(&self, key: &Key, token: Token) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        let (store, key) = (self.clone(), key.clone());
        runtime.spawn(async move {
            if let Err(error) = store.release_with(&key, token, true).await {
                tracing::warn!(key = %key.logged(), %error, "giving back a claim whose answer was lost failed; its lease will run out");
            }
        });
    }

    async fn release_with(
        &self,
        key: &Key,
        token: Token,
        take_back: bool,
    ) -> Result<Transition, StoreError> {
        self.transition(key, false, |record, stat, now| {
            if record.state == b'R' && record.token == Some(token) {
                // This release's own write, whose answer was lost and is sent again.
                return Change::Done;
            }
            if !record.holds(token) {
                return Change::Lost;
            }
            let left = stat.mtime.saturating_add(record.keep) - now;
            let attempts =
                if take_back { record.attempts.saturating_sub(1) } else { record.attempts };
            Change::To(Record {
                state: b'R',
                // Kept: it names the record's keeper, and tells a release sent again.
                token: Some(token),
                lease: 0,
                keep: left.max(1),
                attempts,
                fingerprint: record.fingerprint.clone(),
                result: Vec::new(),
            })
        })
        .await
    }

    /// Records DONE or FAILED (`state`) for `ttl`.
    async fn finish(
        &self,
        key: &Key,
        token: Token,
        state: u8,
        ttl: Duration,
        result: Option<&[u8]>,
    ) -> Result<Transition, StoreError> {
        self.transition(key, false, |record, _, _| {
            if record.state == state && record.token == Some(token) {
                return Change::Done;
            }
            if !record.holds(token) {
                return Change::Lost;
            }
            Change::To(Record {
                state,
                token: Some(token),
                lease: 0,
                keep: millis(ttl),
                attempts: record.attempts,
                fingerprint: record.fingerprint.clone(),
                result: result.unwrap_or_default().to_vec(),
            })
        })
        .await
    }
}

/// Why a claim's write did not go through.
enum Taken {
    /// Another write came between the read and this write: read again.
    Raced,
    /// The record's bucket does not exist yet.
    NoBucket,
    Failed(StoreError),
}

/// What a transition makes of the record it read.
enum Change {
    To(Record),
    /// Already applied, by this same transition.
    Done,
    Lost,
}

/// A record, as its znode holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Record {
    state: u8,
    token: Option<Token>,
    /// The lease, in ms from the znode's `mtime` (claims only).
    lease: i64,
    /// How long the record is kept, in ms from the znode's `mtime`.
    keep: i64,
    attempts: u32,
    /// The fingerprint's hex digits.
    fingerprint: Option<String>,
    result: Vec<u8>,
}

impl Record {
    fn claimed(
        token: Token,
        lease: i64,
        keep: i64,
        attempts: u32,
        fingerprint: Option<String>,
    ) -> Record {
        Record {
            state: b'P',
            token: Some(token),
            lease,
            keep,
            attempts,
            fingerprint,
            result: Vec::new(),
        }
    }

    /// Whether this is `token`'s claim, in progress.
    fn holds(&self, token: Token) -> bool {
        self.state == b'P' && self.token == Some(token)
    }

    fn token_text(&self) -> String {
        self.token.map_or_else(|| "-".to_owned(), |t| t.to_string())
    }

    fn encode(&self) -> Vec<u8> {
        let head = format!(
            "{}{} {} {} {} {} ",
            self.state as char,
            self.token_text(),
            self.lease,
            self.keep,
            self.attempts,
            self.fingerprint.as_deref().unwrap_or("-"),
        );
        let mut data = head.into_bytes();
        data.extend_from_slice(&self.result);
        data
    }

    fn parse(data: &[u8]) -> Option<Record> {
        let (&state, rest) = data.split_first()?;
        if !matches!(state, b'P' | b'R' | b'D' | b'F') {
            return None;
        }
        let mut fields = rest.splitn(6, |&b| b == b' ');
        let mut text = || std::str::from_utf8(fields.next()?).ok();
        let token = match text()? {
            "-" => None,
            hex if hex.len() == 32 => Some(Token::from_u128(u128::from_str_radix(hex, 16).ok()?)),
            _ => return None,
        };
        let lease = text()?.parse().ok()?;
        let keep = text()?.parse().ok()?;
        let attempts = text()?.parse().ok()?;
        let fingerprint = match text()? {
            "-" => None,
            hex if hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()) => {
                Some(hex.to_owned())
            }
            _ => return None,
        };
        let result = fields.next()?.to_vec();
        Some(Record { state, token, lease, keep, attempts, fingerprint, result })
    }
}

/// A zxid as a fence (zxids are never negative).
fn zxid(zxid: i64) -> u64 {
    u64::try_from(zxid).unwrap_or(0)
}

/// Stages writing `data`, a record kept `keep` ms, over the znode read as `stat`: a
/// set checked against its version, or, when the znode's TTL would end before the
/// record, a delete checked the same way and a create with a longer TTL. The znode
/// must have no child left by then.
fn stage_write(
    writer: &mut zk::MultiWriter<'_>,
    path: &str,
    stat: &zk::Stat,
    data: &[u8],
    keep: i64,
    acls: zk::Acls<'static>,
) -> Result<(), zk::Error> {
    if node_ttl(stat.ephemeral_owner) >= node_ttl_for(keep) {
        writer.add_set_data(path, data, Some(stat.version))
    } else {
        writer.add_delete(path, Some(stat.version))?;
        writer.add_create(path, data, &ttl_node(keep, acls))
    }
}

/// A persistent znode holding a record kept `keep` ms.
fn ttl_node(keep: i64, acls: zk::Acls<'static>) -> zk::CreateOptions<'static> {
    persistent(acls).with_ttl(Duration::from_millis(node_ttl_for(keep) as u64))
}

/// The child of the znode at `path` holding `record`: an in-progress record's is the
/// claim's ephemeral child, named after its token; a released, done or failed
/// record's is its keeper, `k` and the token (see [`keeper`]).
fn child_path(path: &str, record: &Record) -> String {
    match record.state {
        b'P' => format!("{path}/{}", record.token_text()),
        _ => format!("{path}/k{}", record.token_text()),
    }
}

/// The keeper of a record that is not in progress: a childless TTL znode under the
/// record's, made in the write that ends the claim (so the record's znode is never
/// without a child), with the TTL of a znode holding a record kept `keep` ms.
///
/// ZooKeeper's reaper lists the TTL znodes that have no children and whose TTL ran
/// out, then deletes them one by one (at most `znode.container.maxPerMinute` a
/// minute, so a long list takes minutes), checking at each delete only that the znode
/// has no children. A key that comes back after its record expired is written over
/// that same znode, which a scan may have listed already; without a child its DONE
/// would go with the listed delete, and a duplicate would run again. With the keeper,
/// that delete finds a child and fails; the keeper itself is a new znode, named after
/// the new claim, which no earlier scan listed. The reaper deletes the keeper once its
/// TTL runs out, then the record's znode.
fn keeper(keep: i64, acls: zk::Acls<'static>) -> zk::CreateOptions<'static> {
    ttl_node(keep, acls)
}

/// The TTL a TTL znode was created with, in ms (0 for any other znode): ZooKeeper
/// keeps it in the low bytes of `ephemeralOwner`, under the marker byte `0xFF`.
fn node_ttl(owner: i64) -> i64 {
    if (owner >> 56) & 0xff == 0xff { owner & 0x00ff_ffff_ffff_ffff } else { 0 }
}

/// The longest TTL a znode can have: 2^40 − 1 ms, about 34.8 years (ZooKeeper keeps it
/// in 40 bits).
const MAX_NODE_TTL: i64 = 0xff_ffff_ffff;

/// How much longer than its record a znode is kept. ZooKeeper's reaper deletes a TTL
/// znode without checking it again (only that it has no children) some time after
/// deciding to, and this store's clock runs a little behind the leader's: without
/// the margin, a record written just as its predecessor expired could be reaped with
/// it.
const NODE_TTL_MARGIN: i64 = 60_000;

/// The TTL of a znode holding a record kept `keep` ms: that plus [`NODE_TTL_MARGIN`],
/// up to [`MAX_NODE_TTL`]. A record kept longer is deleted about 34.8 years after its
/// last write.
fn node_ttl_for(keep: i64) -> i64 {
    keep.saturating_add(NODE_TTL_MARGIN).clamp(1, MAX_NODE_TTL)
}

/// Milliseconds, capped at 100 years, at least 1.
fn millis(d: Duration) -> i64 {
    d.min(crate::execute::Spec::MAX_DURATION).as_millis().max(1) as i64
}

fn persistent(acls: zk::Acls<'static>) -> zk::CreateOptions<'static> {
    zk::CreateMode::Persistent.with_acls(acls)
}

/// A bucket: ZooKeeper deletes it once its last record is gone.
fn container(acls: zk::Acls<'static>) -> zk::CreateOptions<'static> {
    zk::CreateMode::Container.with_acls(acls)
}

fn ephemeral(acls: zk::Acls<'static>) -> zk::CreateOptions<'static> {
    zk::CreateMode::Ephemeral.with_acls(acls)
}

/// Creates `path` and its missing parents as persistent znodes. A node that
/// exists is passed even where the session may not create under its parent
/// (ZooKeeper checks that permission before it looks for the node): whether the
/// session may use the root is [`ZooKeeperStore::check_root`]'s to say.
async fn make_path(
    client: &zk::Client,
    path: &str,
    acls: zk::Acls<'static>,
) -> Result<(), zk::Error> {
    let parents = path.match_indices('/').skip(1).map(|(at, _)| &path[..at]);
    for node in parents.chain([path]) {
        match client.create(node, b"", &persistent(acls)).await {
            Ok(_) | Err(zk::Error::NodeExists) => {}
            Err(zk::Error::NoAuth) if client.check_stat(node).await?.is_some() => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// A ZooKeeper error as a store error. An ACL that refuses the store's session
/// (`NoAuth`, `InvalidAcl`) is the ensemble's setup, not the message's:
/// [`StoreError::Misconfigured`], retried, never dead-lettered. Arguments the server
/// refuses are [`StoreError::Rejected`]; the rest is [`StoreError::Unavailable`].
fn zk_error(error: zk::Error) -> StoreError {
    match error {
        zk::Error::NoAuth | zk::Error::InvalidAcl => StoreError::Misconfigured(format!(
            "ZooKeeper refused the store's session ({error}): the ACL of the records' root or of its records does not let this session create, read, write and delete there"
        )),
        zk::Error::BadArguments(_) => StoreError::Rejected(Box::new(error)),
        other => StoreError::unavailable(other),
    }
}

/// How many records' znodes one page of [`Admin::list`](admin::Admin::list) reads at
/// most before it returns what it found: a filter that few records pass does not
/// make one call read the whole ensemble.
const LIST_READ_BUDGET: usize = 10_000;

/// How many record names one page lists at most (a bucket's children come whole,
/// so a page may go past it by one bucket).
const LIST_NAME_BUDGET: usize = 100_000;

/// How many znodes one page reads at once (pipelined on the session).
const LIST_READS_IN_FLIGHT: usize = 64;

/// Whether `name` is a bucket's: two lower-case hex digits.
fn is_bucket(name: &str) -> bool {
    name.len() == 2 && name.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Whether `name` is a record's: a stored key in lower-case hex.
fn is_record_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() % 2 == 0
        && name.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Where a listing resumes: after the record `child` of `bucket` (from the bucket's
/// first record when `child` is empty). Written `bucket/child`.
fn parse_list_cursor(text: &str) -> Result<(String, String), StoreError> {
    let bad = || StoreError::Protocol(format!("`{text}` is not a cursor `list` gave"));
    let (bucket, child) = text.split_once('/').ok_or_else(bad)?;
    if !is_bucket(bucket) || !(child.is_empty() || is_record_name(child)) {
        return Err(bad());
    }
    Ok((bucket.to_owned(), child.to_owned()))
}

impl ZooKeeperStore {
    /// The record a znode holds, as an operator sees it; `None` when it has expired
    /// (by the leader's clock `now`, in ms).
    fn admin_record(
        stored: Vec<u8>,
        record: &Record,
        stat: &zk::Stat,
        now: i64,
    ) -> Option<admin::Record> {
        let expires = stat.mtime.saturating_add(record.keep);
        if now >= expires {
            return None;
        }
        let state = admin::State::from_letter(record.state)?;
        let lease_until = stat.mtime.saturating_add(record.lease);
        // A claim holds while its lease runs and its session's child exists.
        let lease_left = (record.state == b'P' && now < lease_until && stat.num_children > 0)
            .then(|| Duration::from_millis((lease_until - now) as u64));
        let (namespace, id) = admin::Record::split(&stored);
        Some(admin::Record {
            key: stored,
            namespace,
            id,
            state,
            attempts: record.attempts,
            lease_left,
            ttl_left: Some(Duration::from_millis((expires - now) as u64)),
            fingerprint: record.fingerprint.clone(),
            // An empty result is no cached result: a claim answers `Done` for it.
            result_len: (!record.result.is_empty()).then_some(record.result.len()),
        })
    }

    /// Deletes the znode at `path`, read as `stat`, with its children (a claim's
    /// ephemeral child), if its version is still the one read and it has no other
    /// children. `Ok(false)` when it changed (or went) since it was read.
    async fn delete_record(
        &self,
        client: &zk::Client,
        path: &str,
        stat: &zk::Stat,
        record: Option<&Record>,
    ) -> Result<bool, StoreError> {
        // The claim's child is deleted by the name the record read gives it (its
        // token), as a takeover does: a znode deleted and created again at the same
        // version by a takeover has its new claimant's child, which this then does not
        // name, and the transaction fails instead of deleting a live claim. Only a
        // record that does not parse (deleted under force) has its children listed.
        let children = match (stat.num_children, record) {
            (0, _) => Vec::new(),
            (_, Some(record)) => vec![child_path(path, record)],
            (_, None) => match client.list_children(path).await {
                Ok(children) => children.iter().map(|child| format!("{path}/{child}")).collect(),
                Err(zk::Error::NoNode) => return Ok(false),
                Err(e) => return Err(zk_error(e)),
            },
        };
        let mut writer = client.new_multi_writer();
        let staged = (|| {
            for child in &children {
                writer.add_delete(child, None)?;
            }
            writer.add_delete(path, Some(stat.version))
        })();
        staged.map_err(zk_error)?;
        match writer.commit().await {
            Ok(_) => Ok(true),
            Err(zk::MultiWriteError::OperationFailed {
                source: zk::Error::BadVersion | zk::Error::NoNode | zk::Error::NotEmpty,
                ..
            }) => Ok(false),
            Err(e) => Err(zk_error(e.into())),
        }
    }
}

/// Walks the znodes: `list` goes through the buckets under the root in order, and
/// each bucket's records in the order of their names (the stored key in hex, so in
/// key order within a bucket); the cursor is `bucket/record` of the last record
/// looked at. Times are the leader's clock (each znode's `mtime`, and the store's
/// estimate of the leader's clock now). `release` reads the record, then deletes its
/// znode (with its claim's ephemeral child) in one transaction conditional on the
/// version read and naming the claim's child by the token read, so a record that
/// changed in between stays, a takeover that created the znode again at the same
/// version included; such a race is read again once, then answered `Refused` ("try
/// again"). (A record finished and then taken again by a new claim, at the version
/// read and under the token read, cannot happen: tokens are random.) `purge` answers
/// 0: ZooKeeper deletes expired records itself (TTL znodes, some time after they
/// expire; until then they count as absent). `stats` walks every record.
#[async_trait]
impl admin::Admin for ZooKeeperStore {
    async fn inspect(&self, key: &Key) -> Result<Option<admin::Record>, StoreError> {
        let client = self.client().await?;
        let (path, _) = self.paths(key);
        let Some((record, stat, now)) = self.read(&client, &path).await? else { return Ok(None) };
        Ok(ZooKeeperStore::admin_record(key.stored().into_owned(), &record, &stat, now))
    }

    async fn list(
        &self,
        filter: &admin::Filter,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<admin::Page, StoreError> {
        let client = self.client().await?;
        let root = &self.inner.root;
        let (from_bucket, after) = match cursor {
            Some(text) => parse_list_cursor(text)?,
            None => (String::new(), String::new()),
        };
        let mut buckets = match client.list_children(root).await {
            Ok(children) => children,
            Err(zk::Error::NoNode) => Vec::new(),
            Err(e) => return Err(zk_error(e)),
        };
        buckets.retain(|name| is_bucket(name) && *name >= from_bucket);
        buckets.sort_unstable();
        let prefix = filter.namespace.as_ref().map(|ns| admin::hex(format!("{ns}:").as_bytes()));
        let now = self.now(&client).await?;
        let limit = limit.max(1);
        // Records found, with the bucket and name each is listed under; one beyond
        // the limit tells that more follow.
        let mut found: Vec<(String, String, admin::Record)> = Vec::new();
        let (mut reads, mut names) = (0, 0);
        // Where the next page starts when this one stops before the end.
        let mut resume: Option<String> = None;
        'buckets: for bucket in &buckets {
            if reads >= LIST_READ_BUDGET || names >= LIST_NAME_BUDGET {
                resume = Some(format!("{bucket}/"));
                break;
            }
            let bucket_path = format!("{root}/{bucket}");
            let mut children = match client.list_children(&bucket_path).await {
                Ok(children) => children,
                // A container ZooKeeper deleted once it was empty.
                Err(zk::Error::NoNode) => continue,
                Err(e) => return Err(zk_error(e)),
            };
            names += children.len();
            children.retain(|name| {
                is_record_name(name)
                    && prefix.as_ref().is_none_or(|prefix| name.starts_with(prefix.as_str()))
                    && (*bucket != from_bucket || *name > after)
            });
            children.sort_unstable();
            let mut looked_at: Option<&str> = None;
            for batch in children.chunks(LIST_READS_IN_FLIGHT) {
                if reads >= LIST_READ_BUDGET {
                    resume = Some(format!("{bucket}/{}", looked_at.unwrap_or("")));
                    break 'buckets;
                }
                reads += batch.len();
                let paths: Vec<String> =
                    batch.iter().map(|name| format!("{bucket_path}/{name}")).collect();
                // Sent at once, answered in order.
                let pending: Vec<_> = paths.iter().map(|path| client.get_data(path)).collect();
                for (name, answer) in batch.iter().zip(pending) {
                    looked_at = Some(name);
                    let (data, stat) = match answer.await {
                        Ok(read) => read,
                        Err(zk::Error::NoNode) => continue,
                        Err(e) => return Err(zk_error(e)),
                    };
                    // Not a record this version reads: skipped, as keys of other
                    // programs are in the Redis store's listing.
                    let Some(record) = Record::parse(&data) else { continue };
                    let stored = admin::unhex(name)?;
                    let Some(record) = ZooKeeperStore::admin_record(stored, &record, &stat, now)
                    else {
                        continue;
                    };
                    if record.matches(filter) {
                        found.push((bucket.clone(), name.clone(), record));
                    }
                }
                if found.len() > limit {
                    break 'buckets;
                }
            }
        }
        let next = if found.len() > limit {
            found.truncate(limit);
            found.last().map(|(bucket, name, _)| format!("{bucket}/{name}"))
        } else {
            resume
        };
        let records = found.into_iter().map(|(_, _, record)| record).collect();
        Ok(admin::Page { records, next })
    }

    fn record_key(&self, key: &Key) -> Vec<u8> {
        key.stored().into_owned()
    }

    async fn release_record(
        &self,
        record_key: &[u8],
        expected: Option<admin::State>,
        force: bool,
    ) -> Result<admin::Released, StoreError> {
        let client = self.client().await?;
        let (path, _) = self.paths_of(record_key);
        for _ in 0..2 {
            let (data, stat) = match client.get_data(&path).await {
                Ok(read) => read,
                Err(zk::Error::NoNode) => return Ok(admin::Released::NotFound),
                Err(e) => return Err(zk_error(e)),
            };
            // Read fresh: a process that only reads and deletes (the command, a
            // dashboard) would otherwise judge leases by a clock reading taken at its
            // start, which a leader change may have put ahead of the new leader's.
            let now = self.fresh_now(&client).await?;
            let parsed = Record::parse(&data);
            let answer = match &parsed {
                // The delete is conditional on the version read, so what is checked
                // here is what is deleted.
                None if expected.is_some() => {
                    return Ok(admin::changed(None, expected.unwrap_or(admin::State::Done)));
                }
                None if !force => {
                    return Ok(admin::Released::Refused(
                        "not a record this version reads (written by another program or \
                         version): pass force to delete it"
                            .to_owned(),
                    ));
                }
                None => admin::Released::Released,
                Some(record) => {
                    match ZooKeeperStore::admin_record(record_key.to_vec(), record, &stat, now) {
                        // Expired: absent already; its znode goes all the same.
                        None => admin::Released::NotFound,
                        Some(shown) if expected.is_some_and(|e| e != shown.state) => {
                            let expected = expected.unwrap_or(shown.state);
                            return Ok(admin::changed(Some(shown.state), expected));
                        }
                        Some(shown) if !force => {
                            if let Some(why) = admin::refusal(shown.state, shown.lease_left) {
                                return Ok(admin::Released::Refused(why));
                            }
                            admin::Released::Released
                        }
                        Some(_) => admin::Released::Released,
                    }
                }
            };
            if self.delete_record(&client, &path, &stat, parsed.as_ref()).await? {
                return Ok(answer);
            }
            // Changed since it was read: read it again, once.
        }
        Ok(admin::Released::Refused(
            "the record changed while it was being released: try again".to_owned(),
        ))
    }

    /// ZooKeeper deletes expired records itself (TTL znodes): nothing to do, 0.
    async fn purge(&self) -> Result<u64, StoreError> {
        Ok(0)
    }

    async fn stats(
        &self,
        filter: &admin::Filter,
    ) -> Result<Vec<(String, admin::State, u64)>, StoreError> {
        admin::stats_by_listing(self, filter).await
    }
}

#[async_trait]
impl Store for ZooKeeperStore {
    /// The session timeout granted: once the ensemble stops hearing from a session,
    /// it deletes the session's ephemeral children after that long, and a claim
    /// without its child can be taken over however much lease it has left.
    fn hold_limit(&self) -> Option<Duration> {
        let granted = self.inner.granted_timeout_ms.load(std::sync::atomic::Ordering::Relaxed);
        Some(Duration::from_millis(granted))
    }

    async fn claim(
        &self,
        key: &Key,
        lease: Duration,
        ttl: Duration,
        fingerprint: Option<&Fingerprint>,
    ) -> Result<Claim, StoreError> {
        let client = self.client().await?;
        let token = Token::random();
        let answer = self.claim_with(&client, key, token, lease, ttl, fingerprint).await;
        if let Err(error) = &answer {
            // The claim may have been written and its answer lost: give it back.
            if !error.is_permanent() {
                self.give_back_in_background(key, token);
            }
        }
        answer
    }

    async fn complete(
        &self,
        key: &Key,
        token: Token,
        ttl: Duration,
        result: Option<&[u8]>,
    ) -> Result<Transition, StoreError> {
        self.finish(key, token, b'D', ttl, result).await
    }

    async fn release(&self, key: &Key, token: Token) -> Result<Transition, StoreError> {
        self.release_with(key, token, false).await
    }

    async fn fail(&self, key: &Key, token: Token, ttl: Duration) -> Result<Transition, StoreError> {
        self.finish(key, token, b'F', ttl, None).await
    }

    async fn renew(
        &self,
        key: &Key,
        token: Token,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Transition, StoreError> {
        let (lease, keep) = (millis(lease), millis(claim_retention(lease, ttl)));
        self.transition(key, true, |record, stat, now| {
            if !record.holds(token) {
                return Change::Lost;
            }
            let keep = keep.max(stat.mtime.saturating_add(record.keep) - now);
            Change::To(Record { lease, keep, ..record.clone() })
        })
        .await
    }

    fn abandon(&self, key: &Key, token: Token) {
        super::release_in_background(self, key, token);
    }
}

/// `hosts` to show in a message, with anything before an `@` in a host's address left
/// out: a connect string holds no credentials, but one written as a URL
/// (`zk://user:password@host:port`) may, and a message must not repeat them.
fn without_credentials(hosts: &str) -> String {
    let shown: Vec<String> = hosts
        .split(',')
        .map(|entry| {
            let (scheme, rest) = match entry.find("://") {
                Some(i) => entry.split_at(i + 3),
                None => ("", entry),
            };
            let address_end = rest.find('/').unwrap_or(rest.len());
            match rest[..address_end].rfind('@') {
                Some(at) => format!("{scheme}<credentials>@{}", &rest[at + 1..]),
                None => entry.to_owned(),
            }
        })
        .collect();
    shown.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_leave_credentials_out_of_hosts() {
        assert_eq!(without_credentials("a:2181,b:2181/app"), "a:2181,b:2181/app");
        assert_eq!(
            without_credentials("zk://user:pw@a:2181,b:2181/x@y"),
            "zk://<credentials>@a:2181,b:2181/x@y"
        );
        assert_eq!(without_credentials("user:p@ss@a:2181"), "<credentials>@a:2181");
    }

    #[test]
    fn records_read_back_as_written() {
        let token = Token::random();
        let fingerprint = Some("ab".repeat(32));
        for record in [
            Record::claimed(token, 30_000, 90_000, 3, fingerprint.clone()),
            Record {
                state: b'R',
                token: None,
                lease: 0,
                keep: 5,
                attempts: 2,
                fingerprint: None,
                result: vec![],
            },
            Record {
                state: b'D',
                token: Some(token),
                lease: 0,
                keep: 86_400_000,
                attempts: 1,
                fingerprint,
                result: b"a cached result with spaces \0 and bytes \xff".to_vec(),
            },
        ] {
            assert_eq!(Record::parse(&record.encode()), Some(record));
        }
        for bad in [
            &b""[..],
            b"X- 1 1 1 - ",
            b"P- 1 1 1 -",
            b"Pxyz 1 1 1 - ",
            b"P- a 1 1 - ",
            b"D- 1 1 1 abc ",
        ] {
            assert_eq!(Record::parse(bad), None, "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn list_cursors_name_a_bucket_and_a_record() {
        assert_eq!(parse_list_cursor("0a/6e733a31").unwrap(), ("0a".into(), "6e733a31".into()));
        assert_eq!(parse_list_cursor("ff/").unwrap(), ("ff".into(), String::new()));
        for bad in ["", "0a", "0A/6e", "0a/6e7", "0a/zz", "/6e", "abc/6e", "0a/6e/6e"] {
            assert!(parse_list_cursor(bad).is_err(), "{bad}");
        }
        assert!(is_bucket("7f") && !is_bucket("ttl-check-1"));
    }

    #[test]
    fn ttl_nodes_keep_their_ttl_in_the_owner_field() {
        assert_eq!(node_ttl(0xff00_0000_0000_0000u64 as i64 | 90_000), 90_000);
        assert_eq!(node_ttl(0), 0, "a plain persistent node");
        assert_eq!(node_ttl(0x0123_4567_89ab_cdef), 0, "an ephemeral node's session");
    }
}

/// The znode data format's decoder and encoder, for the fuzz targets (feature
/// `fuzzing`). Not part of the API.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing {
    use super::{Record, parse_list_cursor};
    use crate::{StoreError, Token};

    /// A record's fields, as a znode holds them.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct Fields {
        /// `P`, `R`, `D` or `F`.
        pub state: u8,
        /// The claim's token, if any.
        pub token: Option<u128>,
        /// The lease, in ms from the znode's `mtime`.
        pub lease: i64,
        /// How long the record is kept, in ms from the znode's `mtime`.
        pub keep: i64,
        /// The number of claims.
        pub attempts: u32,
        /// The fingerprint's hex digits.
        pub fingerprint: Option<String>,
        /// The cached result.
        pub result: Vec<u8>,
    }

    /// A znode's data read as a record.
    pub fn parse(data: &[u8]) -> Option<Fields> {
        Record::parse(data).map(|r| Fields {
            state: r.state,
            token: r.token.map(Token::as_u128),
            lease: r.lease,
            keep: r.keep,
            attempts: r.attempts,
            fingerprint: r.fingerprint,
            result: r.result,
        })
    }

    /// A record written as znode data.
    pub fn encode(fields: Fields) -> Vec<u8> {
        Record {
            state: fields.state,
            token: fields.token.map(Token::from_u128),
            lease: fields.lease,
            keep: fields.keep,
            attempts: fields.attempts,
            fingerprint: fields.fingerprint,
            result: fields.result,
        }
        .encode()
    }

    /// A listing cursor read as a bucket and a record name.
    pub fn list_cursor(text: &str) -> Result<(String, String), StoreError> {
        parse_list_cursor(text)
    }
}
