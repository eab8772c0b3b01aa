//! Finding the primary behind Redis Sentinel, as the Sentinel client protocol describes:
//! ask the sentinels for the primary's address by its master name, connect to that
//! address, check with `ROLE` that the node is a primary before trusting it, and listen
//! for the sentinels' `+switch-master`. Both tiers connect through [`Sentinels`] (see
//! [`Client`](super::connection::Client)), and ask again when the sentinels announce a
//! new primary or a call fails for want of a server, so that a failover needs no
//! restart.

use std::time::Duration;

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use redis::{AsyncConnectionConfig, IntoConnectionInfo, Value};

use crate::error::ConfigError;

/// The error code of a master name that no sentinel knows (a configuration error, not
/// an outage: the sentinels answered).
const UNKNOWN_MASTER: &str = "TOLLGATE_UNKNOWN_MASTER";

/// The error code of a node that the sentinels call the primary but is a replica (a
/// failover under way): treated as `READONLY`, an outage.
const NOT_PRIMARY: &str = "READONLY";

/// The sentinels of one master name, and how to reach the data nodes: their scheme
/// (that of the first sentinel's URL), their ACL user and password, and the TLS roots.
#[derive(Clone)]
pub(crate) struct Sentinels {
    sentinels: Vec<redis::Client>,
    master: String,
    tls: bool,
    user: Option<String>,
    password: Option<String>,
    #[cfg_attr(not(feature = "tls"), allow(dead_code))]
    root_cert: Option<Vec<u8>>,
}

impl Sentinels {
    pub(crate) fn new(
        sentinels: Vec<redis::Client>,
        master: String,
        tls: bool,
        user: Option<String>,
        password: Option<String>,
        root_cert: Option<Vec<u8>>,
    ) -> Self {
        Self {
            sentinels,
            master,
            tls,
            user,
            password,
            root_cert,
        }
    }

    /// Asks every sentinel at once for the primary's `(host, port)`, each within
    /// `timeout`: the answers as they come (`None` from a sentinel that monitors no such
    /// master).
    fn ask_all(
        &self,
        timeout: Duration,
    ) -> FuturesUnordered<impl Future<Output = redis::RedisResult<Option<(String, u16)>>> + '_>
    {
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout));
        self.sentinels
            .iter()
            .map(move |sentinel| {
                let config = config.clone();
                async move {
                    let ask = async {
                        let mut connection = sentinel
                            .get_multiplexed_async_connection_with_config(&config)
                            .await?;
                        redis::cmd("SENTINEL")
                            .arg("get-master-addr-by-name")
                            .arg(&self.master)
                            .query_async::<Option<(String, u16)>>(&mut connection)
                            .await
                    };
                    tokio::time::timeout(timeout, ask)
                        .await
                        .unwrap_or_else(|_| Err(timed_out()))
                }
            })
            .collect()
    }

    /// The primary's address, blocking (for a check made outside any runtime): the
    /// first sentinel to name one, each asked in turn within `timeout`.
    pub(crate) fn primary_address_blocking(
        &self,
        timeout: Duration,
    ) -> redis::RedisResult<(String, u16)> {
        let mut unknown = false;
        let mut last = None;
        for sentinel in &self.sentinels {
            let ask = || {
                let mut connection = sentinel.get_connection_with_timeout(timeout)?;
                connection.set_read_timeout(Some(timeout))?;
                redis::cmd("SENTINEL")
                    .arg("get-master-addr-by-name")
                    .arg(&self.master)
                    .query::<Option<(String, u16)>>(&mut connection)
            };
            match ask() {
                Ok(Some(address)) => return Ok(address),
                Ok(None) => unknown = true,
                Err(e) => last = Some(e),
            }
        }
        if unknown {
            return Err(unknown_master(&self.master));
        }
        Err(last.unwrap_or_else(timed_out))
    }

    /// A client of the data node at `host:port`, with the data nodes' scheme,
    /// credentials and TLS roots. Connects nothing.
    pub(crate) fn data_client(
        &self,
        (host, port): &(String, u16),
    ) -> redis::RedisResult<redis::Client> {
        let scheme = if self.tls { "rediss" } else { "redis" };
        let host = if host.contains(':') {
            format!("[{host}]")
        } else {
            host.clone()
        };
        let info = format!("{scheme}://{host}:{port}/").into_connection_info()?;
        let mut settings = info.redis_settings().clone();
        if let Some(user) = &self.user {
            settings = settings.set_username(user);
        }
        if let Some(password) = &self.password {
            settings = settings.set_password(password);
        }
        let info = info.set_redis_settings(settings);
        match &self.root_cert {
            #[cfg(feature = "tls")]
            Some(pem) => redis::Client::build_with_tls(
                info,
                redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(pem.clone()),
                },
            ),
            _ => redis::Client::open(info),
        }
    }

    /// A client of the current primary, checked to be one (`ROLE`) within `timeout`.
    ///
    /// Every sentinel is asked at once, and the first address to answer is tried. During
    /// a failover some sentinels still name the old primary, which is dead or demoted:
    /// then each further address the others give is tried, until one is a primary. A
    /// sentinel that is down or paused costs nothing while another answers.
    ///
    /// # Errors
    /// [`UNKNOWN_MASTER`] if the sentinels that answered all said they monitor no such
    /// master; otherwise the last error (a sentinel's, or a named node's), or a
    /// timeout.
    pub(crate) async fn primary(&self, timeout: Duration) -> redis::RedisResult<redis::Client> {
        let mut answers = self.ask_all(timeout);
        let mut tried: Vec<(String, u16)> = Vec::new();
        let mut unknown = false;
        let mut last = None;
        while let Some(answer) = answers.next().await {
            match answer {
                Ok(Some(address)) if !tried.contains(&address) => {
                    match self.verified(&address, timeout).await {
                        Ok(client) => return Ok(client),
                        Err(e) => last = Some(e),
                    }
                    tried.push(address);
                }
                Ok(Some(_)) => {}
                Ok(None) => unknown = true,
                Err(e) => last = Some(e),
            }
        }
        if unknown && tried.is_empty() {
            return Err(unknown_master(&self.master));
        }
        Err(last.unwrap_or_else(timed_out))
    }

    /// A client of the node at `address` if it says it is a primary (`ROLE`) within
    /// `timeout`.
    async fn verified(
        &self,
        address: &(String, u16),
        timeout: Duration,
    ) -> redis::RedisResult<redis::Client> {
        let client = self.data_client(address)?;
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout));
        let check = async {
            let mut connection = client
                .get_multiplexed_async_connection_with_config(&config)
                .await?;
            let role: Value = redis::cmd("ROLE").query_async(&mut connection).await?;
            Ok::<_, redis::RedisError>(is_primary(&role))
        };
        match tokio::time::timeout(timeout, check).await {
            Ok(Ok(true)) => Ok(client),
            Ok(Ok(false)) => Err(not_primary()),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(timed_out()),
        }
    }

    /// How many sentinels there are.
    pub(crate) fn len(&self) -> usize {
        self.sentinels.len()
    }

    /// A subscription to the `+switch-master` events of the `which`-th sentinel, made
    /// within `timeout` (at least 500 ms); `None` if it failed.
    pub(crate) async fn switches(
        &self,
        which: usize,
        timeout: Duration,
    ) -> Option<redis::aio::PubSub> {
        let sentinel = self.sentinels.get(which)?;
        let subscribe = async {
            let mut pubsub = sentinel.get_async_pubsub().await?;
            pubsub.subscribe("+switch-master").await?;
            Ok::<_, redis::RedisError>(pubsub)
        };
        tokio::time::timeout(timeout.max(Duration::from_millis(500)), subscribe)
            .await
            .ok()?
            .ok()
    }

    /// Whether a `+switch-master` event (`<master name> <old ip> <old port> <new ip>
    /// <new port>`) is about this master.
    pub(crate) fn names_master(&self, event: &str) -> bool {
        event.split(' ').next() == Some(self.master.as_str())
    }

    /// Runs `cmd` on the primary, blocking: the address the first sentinel names,
    /// checked with `ROLE` first.
    pub(crate) fn query_blocking(
        &self,
        timeout: Duration,
        cmd: &redis::Cmd,
    ) -> redis::RedisResult<Value> {
        let address = self.primary_address_blocking(timeout)?;
        let mut connection = self
            .data_client(&address)?
            .get_connection_with_timeout(timeout)?;
        connection.set_read_timeout(Some(timeout))?;
        let role: Value = redis::cmd("ROLE").query(&mut connection)?;
        if !is_primary(&role) {
            return Err(not_primary());
        }
        cmd.query(&mut connection)
    }
}

/// Whether a `ROLE` reply is a primary's (`["master", offset, replicas]`).
pub(crate) fn is_primary(role: &Value) -> bool {
    let Value::Array(fields) = role else {
        return false;
    };
    match fields.first() {
        Some(Value::BulkString(role)) => role == b"master",
        Some(Value::SimpleString(role)) => role == "master",
        _ => false,
    }
}

/// The error's detail is the master name alone ([`master_unknown`] reads it back).
fn unknown_master(master: &str) -> redis::RedisError {
    redis::make_extension_error(UNKNOWN_MASTER.to_owned(), Some(master.to_owned()))
}

/// The master name an error says no sentinel knows, if it says that.
pub(crate) fn master_unknown(e: &redis::RedisError) -> Option<ConfigError> {
    (e.code() == Some(UNKNOWN_MASTER))
        .then(|| ConfigError::UnknownSentinelMaster(e.detail().unwrap_or_default().to_owned()))
}

fn not_primary() -> redis::RedisError {
    redis::make_extension_error(
        NOT_PRIMARY.to_owned(),
        Some(
            "the node the sentinels report as primary is a replica (a failover is under way)"
                .to_owned(),
        ),
    )
}

fn timed_out() -> redis::RedisError {
    redis::RedisError::from(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        "no sentinel answered in time",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_primary_is_told_from_a_replica_by_its_role() {
        let master = Value::Array(vec![
            Value::BulkString(b"master".to_vec()),
            Value::Int(0),
            Value::Array(vec![]),
        ]);
        let replica = Value::Array(vec![
            Value::BulkString(b"slave".to_vec()),
            Value::BulkString(b"127.0.0.1".to_vec()),
        ]);
        assert!(is_primary(&master));
        assert!(!is_primary(&replica));
        assert!(!is_primary(&Value::Nil));
    }

    #[test]
    fn switch_events_are_told_apart_by_master_name() {
        let sentinels = Sentinels::new(Vec::new(), "orders".to_owned(), false, None, None, None);
        assert!(sentinels.names_master("orders 10.0.0.1 6379 10.0.0.2 6379"));
        assert!(!sentinels.names_master("orders-eu 10.0.0.1 6379 10.0.0.2 6379"));
        assert!(!sentinels.names_master(""));
    }

    #[test]
    fn data_nodes_get_the_credentials_and_scheme_without_a_url() {
        // A password with URL metacharacters needs no encoding: it is never in a URL.
        let sentinels = Sentinels::new(
            Vec::new(),
            "m".to_owned(),
            false,
            Some("app".to_owned()),
            Some("p@ss/w:rd".to_owned()),
            None,
        );
        let client = sentinels
            .data_client(&("::1".to_owned(), 6380))
            .expect("parses");
        let info = client.get_connection_info();
        assert_eq!(info.redis_settings().username(), Some("app"));
        assert_eq!(info.redis_settings().password(), Some("p@ss/w:rd"));
        assert!(info.addr().to_string().contains("6380"), "{}", info.addr());
    }
}
