//! Which bucket a request belongs to: the client's address (safely behind proxies), a
//! header such as an API key, or a closure.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::str::FromStr;
use std::sync::Arc;

use http::header::{FORWARDED, HeaderName};
use http::{Extensions, Request};

use super::extract::{ExtractKey, KeyLimits, KeyRejection, TextKey};
use crate::error::ConfigError;

/// An IP network: an address and a prefix length, as in `10.0.0.0/8` or `2001:db8::/32`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cidr {
    addr: IpAddr,
    prefix: u8,
}

impl Cidr {
    /// Whether `ip` lies in this network. IPv4-mapped IPv6 addresses match IPv4 networks.
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, canonical(ip)) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => mask_v4(ip, self.prefix) == net,
            (IpAddr::V6(net), IpAddr::V6(ip)) => mask_v6(ip, self.prefix) == net,
            _ => false,
        }
    }
}

impl FromStr for Cidr {
    type Err = ConfigError;

    /// Parses `ADDR/PREFIX`, or a bare address (a single host).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = |why: &str| ConfigError::InvalidCidr(format!("{s:?}: {why}"));
        let (addr, prefix) = match s.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s, None),
        };
        let addr: IpAddr = addr.trim().parse().map_err(|_| bad("not an IP address"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            None => max,
            Some(p) => p
                .trim()
                .parse::<u8>()
                .ok()
                .filter(|p| *p <= max)
                .ok_or_else(|| bad("the prefix length is out of range"))?,
        };
        let addr = match canonical(addr) {
            IpAddr::V4(a) => IpAddr::V4(mask_v4(a, prefix.min(32))),
            IpAddr::V6(a) => IpAddr::V6(mask_v6(a, prefix)),
        };
        Ok(Self { addr, prefix })
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

fn mask_v4(ip: Ipv4Addr, prefix: u8) -> Ipv4Addr {
    let bits = u32::from(ip);
    Ipv4Addr::from(if prefix == 0 {
        0
    } else {
        bits & (u32::MAX << (32 - u32::from(prefix)))
    })
}

fn mask_v6(ip: Ipv6Addr, prefix: u8) -> Ipv6Addr {
    let bits = u128::from(ip);
    Ipv6Addr::from(if prefix == 0 {
        0
    } else {
        bits & (u128::MAX << (128 - u32::from(prefix)))
    })
}

/// The bucket of an address: IPv6 addresses are cut to `v6_prefix` bits (one subscriber
/// usually holds a whole /64), IPv4 addresses are kept whole.
pub(crate) fn ip_key(ip: IpAddr, v6_prefix: u8) -> TextKey<'static> {
    match canonical(ip) {
        IpAddr::V4(v4) => v4_key(v4),
        IpAddr::V6(v6) => {
            let written = TextKey::inline(|w| write!(w, "{}/{v6_prefix}", mask_v6(v6, v6_prefix)));
            // The longest, "ffff:…:ffff/128", is 43 bytes: it always fits the stack buffer.
            written.unwrap_or_else(|| TextKey::owned(ip.to_string()))
        }
    }
}

/// `ip` in dotted decimal, as `Display` writes it, straight into a stack key (this runs
/// on every request keyed by an IPv4 address).
fn v4_key(ip: Ipv4Addr) -> TextKey<'static> {
    let mut text = [0u8; 15];
    let mut len = 0;
    for (i, octet) in ip.octets().into_iter().enumerate() {
        if i > 0 {
            text[len] = b'.';
            len += 1;
        }
        if octet >= 100 {
            text[len] = b'0' + octet / 100;
            len += 1;
        }
        if octet >= 10 {
            text[len] = b'0' + octet / 10 % 10;
            len += 1;
        }
        text[len] = b'0' + octet % 10;
        len += 1;
    }
    TextKey::ascii(&text[..len])
}

/// The peer address of the connection, as the server recorded it in the request's
/// extensions: axum's `ConnectInfo<SocketAddr>` (with the `axum` feature), tonic's
/// `TcpConnectInfo` (with the `tonic` feature) or a plain `SocketAddr` (which a hyper
/// server can insert).
pub(crate) fn peer_ip(extensions: &Extensions) -> Option<IpAddr> {
    #[cfg(feature = "axum")]
    if let Some(axum::extract::ConnectInfo(addr)) =
        extensions.get::<axum::extract::ConnectInfo<SocketAddr>>()
    {
        return Some(addr.ip());
    }
    #[cfg(feature = "tonic")]
    if let Some(addr) = extensions
        .get::<tonic::transport::server::TcpConnectInfo>()
        .and_then(tonic::transport::server::TcpConnectInfo::remote_addr)
    {
        return Some(addr.ip());
    }
    extensions.get::<SocketAddr>().map(SocketAddr::ip)
}

/// The hops that forwarding headers claim, in order from the client to the last proxy:
/// every `X-Forwarded-For` entry, or the `for=` of every `Forwarded` element if there is
/// no `X-Forwarded-For`. `None` for an entry that is not an address.
fn forwarded_hops<B>(req: &Request<B>) -> Vec<Option<IpAddr>> {
    let xff = HeaderName::from_static("x-forwarded-for");
    let mut hops: Vec<Option<IpAddr>> = req
        .headers()
        .get_all(&xff)
        .iter()
        .flat_map(|v| v.to_str().unwrap_or("\u{0}").split(','))
        .map(|entry| parse_hop(entry.trim()))
        .collect();
    if hops.is_empty() {
        hops = req
            .headers()
            .get_all(FORWARDED)
            .iter()
            .flat_map(|v| v.to_str().unwrap_or("for=\u{0}").split(','))
            .filter_map(|element| {
                element.split(';').find_map(|pair| {
                    let (name, value) = pair.trim().split_once('=')?;
                    name.trim()
                        .eq_ignore_ascii_case("for")
                        .then(|| parse_hop(value.trim().trim_matches('"')))
                })
            })
            .collect();
    }
    hops
}

/// An address from a forwarding header: `1.2.3.4`, `1.2.3.4:80`, `2001:db8::1`,
/// `[2001:db8::1]` or `[2001:db8::1]:80`.
fn parse_hop(s: &str) -> Option<IpAddr> {
    if let Ok(ip) = s.parse() {
        return Some(ip);
    }
    if let Ok(sock) = s.parse::<SocketAddr>() {
        return Some(sock.ip());
    }
    s.strip_prefix('[')?.split_once(']')?.0.parse().ok()
}

/// The client's address behind `trusted` proxies: walking from the connection's peer
/// towards the client, the first address that is not a trusted proxy. A hop that is not
/// an address stops the walk at the last trusted proxy (so a forged entry never picks a
/// bucket); if every hop is trusted, the first one is the client.
pub(crate) fn client_ip<B>(req: &Request<B>, trusted: &[Cidr]) -> Option<IpAddr> {
    let peer = peer_ip(req.extensions())?;
    if !trusted.iter().any(|net| net.contains(peer)) {
        return Some(peer);
    }
    let mut last = peer;
    for hop in forwarded_hops(req).into_iter().rev() {
        let Some(ip) = hop else { return Some(last) };
        if !trusted.iter().any(|net| net.contains(ip)) {
            return Some(ip);
        }
        last = ip;
    }
    Some(last)
}

/// How the layer finds a request's bucket, by the connection or a header; to key by a
/// closure of the request (for keys of any type), see [`key_fn`](super::key_fn).
///
/// ```
/// use tollgate::http::{KeyExtractor, RateLimitLayer};
/// use tollgate::RateLimiter;
///
/// let limiter: RateLimiter<String> = RateLimiter::new("10/s".parse()?);
/// let by_peer = KeyExtractor::peer_ip();
/// let behind_proxies = KeyExtractor::client_ip(["10.0.0.0/8".parse()?, "fd00::/8".parse()?]);
/// let by_api_key = KeyExtractor::header("x-api-key")?;
/// let layer = RateLimitLayer::new(limiter).key(by_api_key);
/// # let _ = (by_peer, behind_proxies, layer);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
#[non_exhaustive]
pub enum KeyExtractor {
    /// The connection's peer address (axum's `ConnectInfo`, tonic's `TcpConnectInfo`, or
    /// a `SocketAddr` extension); IPv6 addresses are grouped by their first `v6_prefix`
    /// bits (64 by default). Forwarding headers are ignored.
    PeerIp {
        /// Bits of an IPv6 address that name a client.
        v6_prefix: u8,
    },
    /// The client's address behind the given trusted proxies: the rightmost
    /// `X-Forwarded-For` (or `Forwarded`) address that is not a trusted proxy. A request
    /// from an untrusted peer is keyed by the peer, whatever its headers say.
    ClientIp {
        /// The networks of the proxies in front of this server.
        trusted: Arc<[Cidr]>,
        /// Bits of an IPv6 address that name a client.
        v6_prefix: u8,
    },
    /// A header's value, such as an API key. A value that is not UTF-8 gets a 400; an
    /// empty one is missing.
    Header(HeaderName),
}

impl fmt::Debug for KeyExtractor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::PeerIp { v6_prefix } => write!(f, "PeerIp(/{v6_prefix})"),
            Self::ClientIp { trusted, v6_prefix } => {
                write!(f, "ClientIp({trusted:?}, /{v6_prefix})")
            }
            Self::Header(name) => write!(f, "Header({name})"),
        }
    }
}

impl KeyExtractor {
    /// The peer address, IPv6 grouped by /64.
    pub fn peer_ip() -> Self {
        Self::PeerIp { v6_prefix: 64 }
    }

    /// The client address behind `trusted` proxies, IPv6 grouped by /64. With no
    /// trusted proxy this is [`peer_ip`](Self::peer_ip).
    pub fn client_ip(trusted: impl IntoIterator<Item = Cidr>) -> Self {
        Self::ClientIp {
            trusted: trusted.into_iter().collect(),
            v6_prefix: 64,
        }
    }

    /// The value of header `name`.
    ///
    /// # Errors
    /// [`ConfigError::InvalidHeaderName`] for a name that is not a valid header name.
    pub fn header(name: &str) -> Result<Self, ConfigError> {
        HeaderName::from_bytes(name.as_bytes())
            .map(Self::Header)
            .map_err(|_| ConfigError::InvalidHeaderName(name.to_owned()))
    }
}

impl ExtractKey<String> for KeyExtractor {
    type Lookup = str;
    type Key<'r> = TextKey<'r>;

    fn extract<'r, B>(
        &self,
        req: &'r Request<B>,
        limits: &KeyLimits,
    ) -> Result<TextKey<'r>, KeyRejection> {
        match self {
            Self::PeerIp { v6_prefix } => peer_ip(req.extensions())
                .map(|ip| ip_key(ip, *v6_prefix))
                .ok_or(KeyRejection::Missing),
            Self::ClientIp { trusted, v6_prefix } => client_ip(req, trusted)
                .map(|ip| ip_key(ip, *v6_prefix))
                .ok_or(KeyRejection::Missing),
            Self::Header(name) => match req.headers().get(name) {
                Some(value) => limits.bytes(value.as_bytes()),
                None => Err(KeyRejection::Missing),
            },
        }
    }

    fn looks_for<B>(&self, req: &Request<B>) -> String {
        let peer = match self {
            Self::PeerIp { .. } => "the peer address",
            Self::ClientIp { .. } => {
                "the client address (the peer address, or what trusted proxies forwarded)"
            }
            Self::Header(name) => return format!("the `{name}` header"),
        };
        let grpc = super::extract::is_grpc(req);
        match peer_address_hint(grpc, cfg!(feature = "tonic"), cfg!(feature = "axum")) {
            Some(hint) => format!("{peer}; {hint}"),
            None => peer.to_owned(),
        }
    }
}

/// Why a request may lack a peer address though its server has one: the connection
/// info of tonic and axum is read only with tollgate's `tonic` and `axum` features
/// (`tonic` and `axum`: whether they are on).
fn peer_address_hint(grpc: bool, tonic: bool, axum: bool) -> Option<&'static str> {
    if grpc && !tonic {
        Some("a tonic server's peer address is read only with tollgate's `tonic` feature")
    } else if !grpc && !axum {
        Some(
            "axum's `ConnectInfo` is read only with tollgate's `axum` feature (with hyper, \
             insert the connection's `SocketAddr` into the request's extensions)",
        )
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_peer_address_names_the_feature_that_reads_it() {
        let grpc = peer_address_hint(true, false, true).unwrap();
        assert!(grpc.contains("`tonic` feature"), "{grpc}");
        assert_eq!(peer_address_hint(true, true, false), None);
        let http = peer_address_hint(false, true, false).unwrap();
        assert!(http.contains("`axum` feature"), "{http}");
        assert_eq!(peer_address_hint(false, false, true), None);
        // With every feature on (as here), a request's message names only the address.
        let mut req = Request::new(());
        req.headers_mut()
            .insert("content-type", "application/grpc".parse().unwrap());
        assert_eq!(KeyExtractor::peer_ip().looks_for(&req), "the peer address");
        assert_eq!(
            KeyExtractor::header("x-api-key").unwrap().looks_for(&req),
            "the `x-api-key` header"
        );
    }

    fn request(peer: &str, headers: &[(&str, &str)]) -> Request<()> {
        let mut req = Request::new(());
        req.extensions_mut()
            .insert(SocketAddr::new(peer.parse().unwrap(), 4000));
        for (name, value) in headers {
            req.headers_mut().append(
                HeaderName::from_bytes(name.as_bytes()).unwrap(),
                value.parse().unwrap(),
            );
        }
        req
    }

    fn cidrs(list: &[&str]) -> Vec<Cidr> {
        list.iter().map(|c| c.parse().unwrap()).collect()
    }

    #[test]
    fn cidrs_parse_and_match() {
        let net: Cidr = "10.1.2.3/8".parse().unwrap();
        assert_eq!(net.to_string(), "10.0.0.0/8");
        assert!(net.contains("10.200.0.1".parse().unwrap()));
        assert!(net.contains("::ffff:10.0.0.9".parse().unwrap()));
        assert!(!net.contains("11.0.0.1".parse().unwrap()));
        let v6: Cidr = "2001:db8::/32".parse().unwrap();
        assert!(v6.contains("2001:db8:ffff::1".parse().unwrap()));
        assert!("10.0.0.0/33".parse::<Cidr>().is_err());
        assert!(
            "nonsense"
                .parse::<Cidr>()
                .unwrap_err()
                .to_string()
                .contains("not an IP address")
        );
        assert!(
            "127.0.0.1"
                .parse::<Cidr>()
                .unwrap()
                .contains("127.0.0.1".parse().unwrap())
        );
    }

    #[test]
    fn forwarding_headers_are_ignored_from_untrusted_peers() {
        let req = request("203.0.113.7", &[("x-forwarded-for", "1.1.1.1")]);
        assert_eq!(
            client_ip(&req, &cidrs(&["10.0.0.0/8"])),
            Some("203.0.113.7".parse().unwrap())
        );
    }

    #[test]
    fn the_rightmost_untrusted_hop_is_the_client() {
        let trusted = cidrs(&["10.0.0.0/8"]);
        // A client that forged "6.6.6.6" in front of its real address 198.51.100.4.
        let req = request(
            "10.0.0.2",
            &[("x-forwarded-for", "6.6.6.6, 198.51.100.4, 10.0.0.5")],
        );
        assert_eq!(
            client_ip(&req, &trusted),
            Some("198.51.100.4".parse().unwrap())
        );
        let req = request(
            "10.0.0.2",
            &[(
                "forwarded",
                "for=6.6.6.6, for=\"[2001:db8::7]:443\";proto=https",
            )],
        );
        assert_eq!(
            client_ip(&req, &trusted),
            Some("2001:db8::7".parse().unwrap())
        );
        // Garbage stops the walk at the last trusted proxy.
        let req = request(
            "10.0.0.2",
            &[("x-forwarded-for", "198.51.100.4, not-an-ip, 10.0.0.5")],
        );
        assert_eq!(client_ip(&req, &trusted), Some("10.0.0.5".parse().unwrap()));
        // Several header lines are one list.
        let req = request(
            "10.0.0.2",
            &[
                ("x-forwarded-for", "198.51.100.4"),
                ("x-forwarded-for", "10.0.0.9"),
            ],
        );
        assert_eq!(
            client_ip(&req, &trusted),
            Some("198.51.100.4".parse().unwrap())
        );
    }

    #[test]
    fn ipv4_keys_are_written_as_display_writes_them() {
        for ip in [
            "0.0.0.0",
            "1.2.3.4",
            "10.0.0.255",
            "99.100.101.9",
            "255.255.255.255",
        ] {
            assert_eq!(ip_key(ip.parse().unwrap(), 64).as_str(), ip);
        }
        for n in (0..=u32::MAX).step_by(65_537) {
            let ip = Ipv4Addr::from(n);
            assert_eq!(ip_key(IpAddr::V4(ip), 64).as_str(), ip.to_string());
        }
    }

    #[test]
    fn ipv6_clients_are_grouped_by_prefix() {
        assert_eq!(
            ip_key("2001:db8:1:2:aaaa::1".parse().unwrap(), 64).as_str(),
            "2001:db8:1:2::/64"
        );
        assert_eq!(
            ip_key("2001:db8:1:2:bbbb::9".parse().unwrap(), 64).as_str(),
            "2001:db8:1:2::/64"
        );
        assert_eq!(
            ip_key("::ffff:192.0.2.1".parse().unwrap(), 64).as_str(),
            "192.0.2.1"
        );
    }
}
