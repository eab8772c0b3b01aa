//! The body of a rate-limited response: the inner service's, or the layer's own.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

pin_project! {
    #[allow(missing_docs)] // pin-project-lite takes no docs on a pinned field; see above.
    /// The response body of a [`RateLimitService`](super::RateLimitService): the inner
    /// service's body for an admitted request, or the layer's own (a 429's JSON, an empty
    /// gRPC body) for a request it answered itself.
    ///
    /// `Inner { body }` holds the inner body; `Own { bytes }` the bytes of the layer's own
    /// body not yet sent (`None` once sent, or for an empty body).
    ///
    /// It is an [`http_body::Body`] whenever the inner body is one with `Bytes` data, so
    /// the layer composes with any service and with tower-http's layers, in any order.
    #[project = BodyProjection]
    pub enum RateLimitBody<B> {
        /// The inner service's body.
        Inner {
            #[pin]
            body: B,
        },
        /// The layer's own body, sent as one frame.
        Own {
            bytes: Option<Bytes>,
        },
    }
}

impl<B> RateLimitBody<B> {
    /// The inner service's body.
    pub fn inner(body: B) -> Self {
        Self::Inner { body }
    }

    /// A body of the layer's own.
    pub(crate) fn own(bytes: impl Into<Bytes>) -> Self {
        let bytes: Bytes = bytes.into();
        Self::Own {
            bytes: (!bytes.is_empty()).then_some(bytes),
        }
    }

    /// Whether the layer wrote this body (the request was answered by the layer).
    pub fn is_own(&self) -> bool {
        matches!(self, Self::Own { .. })
    }
}

/// An empty body of the layer's own (what tower-http's `TimeoutLayer` answers with when
/// it wraps the rate-limit layer).
impl<B> Default for RateLimitBody<B> {
    fn default() -> Self {
        Self::Own { bytes: None }
    }
}

impl<B: std::fmt::Debug> std::fmt::Debug for RateLimitBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Inner { body } => f.debug_tuple("Inner").field(body).finish(),
            Self::Own { bytes } => f.debug_tuple("Own").field(bytes).finish(),
        }
    }
}

impl<B> Body for RateLimitBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.project() {
            BodyProjection::Inner { body } => body.poll_frame(cx),
            BodyProjection::Own { bytes } => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Self::Inner { body } => body.is_end_stream(),
            Self::Own { bytes } => bytes.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Self::Inner { body } => body.size_hint(),
            Self::Own { bytes } => {
                SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Polls a body to its end, collecting its data.
    fn collect<B: Body<Data = Bytes> + Unpin>(mut body: B) -> Vec<u8>
    where
        B::Error: std::fmt::Debug,
    {
        let waker = std::task::Waker::noop();
        let mut cx = Context::from_waker(waker);
        let mut out = Vec::new();
        loop {
            match Pin::new(&mut body).poll_frame(&mut cx) {
                Poll::Ready(Some(frame)) => {
                    if let Ok(data) = frame.unwrap().into_data() {
                        out.extend_from_slice(&data);
                    }
                }
                Poll::Ready(None) => return out,
                Poll::Pending => panic!("an in-memory body never waits"),
            }
        }
    }

    #[test]
    fn own_bodies_are_one_frame_with_an_exact_size() {
        let body: RateLimitBody<String> = RateLimitBody::own("{\"a\":1}");
        assert_eq!(body.size_hint().exact(), Some(7));
        assert!(!body.is_end_stream());
        assert_eq!(collect(body), b"{\"a\":1}");
        let empty: RateLimitBody<String> = RateLimitBody::own(Bytes::new());
        assert!(empty.is_end_stream());
        assert_eq!(empty.size_hint().exact(), Some(0));
        assert!(collect(empty).is_empty());
    }

    #[test]
    fn inner_bodies_pass_through() {
        let body = RateLimitBody::inner(String::from("hello"));
        assert!(!body.is_own());
        assert_eq!(body.size_hint().exact(), Some(5));
        assert_eq!(collect(body), b"hello");
    }
}
