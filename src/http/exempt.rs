//! Requests the layer lets through without limiting them: health checks, preflights,
//! the monitoring network.

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;

use http::{Method, Request};

use super::extract::RequestHead;
use super::key::{Cidr, peer_ip};

/// A predicate of the request's head.
pub(crate) type Predicate = Arc<dyn Fn(&RequestHead<'_>) -> bool + Send + Sync>;

/// The requests a layer exempts: any path, method, network or predicate match exempts.
#[derive(Clone, Default)]
pub(crate) struct Exempt {
    paths: HashSet<String>,
    prefixes: Vec<String>,
    methods: Vec<Method>,
    networks: Vec<Cidr>,
    predicates: Vec<Predicate>,
}

impl fmt::Debug for Exempt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Exempt")
            .field("paths", &self.paths)
            .field("prefixes", &self.prefixes)
            .field("methods", &self.methods)
            .field("networks", &self.networks)
            .field("predicates", &self.predicates.len())
            .finish()
    }
}

impl Exempt {
    /// Adds paths: exact (`/healthz`), or prefixes when they end in `*` (`/static/*`).
    pub(crate) fn paths<I, P>(&mut self, paths: I)
    where
        I: IntoIterator<Item = P>,
        P: Into<String>,
    {
        for path in paths {
            let path: String = path.into();
            match path.strip_suffix('*') {
                Some(prefix) => self.prefixes.push(prefix.to_owned()),
                None => {
                    self.paths.insert(path);
                }
            }
        }
    }

    pub(crate) fn methods(&mut self, methods: impl IntoIterator<Item = Method>) {
        self.methods.extend(methods);
    }

    pub(crate) fn networks(&mut self, networks: impl IntoIterator<Item = Cidr>) {
        self.networks.extend(networks);
    }

    pub(crate) fn predicate(&mut self, predicate: Predicate) {
        self.predicates.push(predicate);
    }

    /// Whether nothing is exempt (the common case, checked first).
    pub(crate) fn is_empty(&self) -> bool {
        self.paths.is_empty()
            && self.prefixes.is_empty()
            && self.methods.is_empty()
            && self.networks.is_empty()
            && self.predicates.is_empty()
    }

    /// Whether `req` is exempt.
    pub(crate) fn matches<B>(&self, req: &Request<B>) -> bool {
        if self.is_empty() {
            return false;
        }
        let path = req.uri().path();
        if self.paths.contains(path) || self.prefixes.iter().any(|p| path.starts_with(p.as_str())) {
            return true;
        }
        if self.methods.contains(req.method()) {
            return true;
        }
        if !self.networks.is_empty()
            && peer_ip(req.extensions())
                .is_some_and(|ip| self.networks.iter().any(|n| n.contains(ip)))
        {
            return true;
        }
        if self.predicates.is_empty() {
            return false;
        }
        let head = RequestHead::of(req);
        self.predicates.iter().any(|p| p(&head))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::SocketAddr;

    fn request(method: Method, path: &str, peer: &str) -> Request<()> {
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .body(())
            .unwrap();
        req.extensions_mut()
            .insert(SocketAddr::new(peer.parse().unwrap(), 1234));
        req
    }

    #[test]
    fn paths_methods_networks_and_predicates_exempt() {
        let mut exempt = Exempt::default();
        assert!(!exempt.matches(&request(Method::GET, "/healthz", "1.2.3.4")));
        exempt.paths(["/healthz", "/static/*"]);
        exempt.methods([Method::OPTIONS]);
        exempt.networks(["10.0.0.0/8".parse().unwrap()]);
        exempt.predicate(Arc::new(|head: &RequestHead<'_>| {
            head.headers.contains_key("x-internal")
        }));
        assert!(exempt.matches(&request(Method::GET, "/healthz", "1.2.3.4")));
        assert!(exempt.matches(&request(Method::GET, "/healthz?full=1", "1.2.3.4")));
        assert!(!exempt.matches(&request(Method::GET, "/healthz/deep", "1.2.3.4")));
        assert!(exempt.matches(&request(Method::GET, "/static/app.js", "1.2.3.4")));
        assert!(exempt.matches(&request(Method::OPTIONS, "/api", "1.2.3.4")));
        assert!(exempt.matches(&request(Method::GET, "/api", "10.9.8.7")));
        assert!(!exempt.matches(&request(Method::GET, "/api", "11.0.0.1")));
        let mut internal = request(Method::GET, "/api", "1.2.3.4");
        internal
            .headers_mut()
            .insert("x-internal", "1".parse().unwrap());
        assert!(exempt.matches(&internal));
    }
}
