//! The future a [`RateLimitService`](super::RateLimitService) returns.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::Response;
use pin_project_lite::pin_project;

use super::body::RateLimitBody;
use super::response::{Made, Style, insert_made};
use crate::decision::Decision;

/// A boxed future, for responses that wait: on the Redis tier's decision, or on a shaped
/// request's slot.
pub(crate) type BoxFuture<B, E> =
    Pin<Box<dyn Future<Output = Result<Response<RateLimitBody<B>>, E>> + Send>>;

pin_project! {
    /// The response to a rate-limited request: the inner service's, with the rate-limit
    /// headers added, or the layer's own 429 (or 400, or gRPC status).
    #[project = Projection]
    pub struct ResponseFuture<F, B, E> {
        #[pin]
        state: State<F, B, E>,
    }
}

/// The rate-limit headers an admitted request's response gets.
pub(crate) enum Pending {
    /// None: the request was exempt.
    None,
    /// Values made once (the common case): no reference count to bump.
    Made(Made),
    /// Values made when the response arrives.
    Later(Decision, Arc<Style>),
}

pin_project! {
    #[project = StateProjection]
    enum State<F, B, E> {
        /// Passed to the inner service: its future, and the decision whose headers its
        /// response gets (none for an exempt request).
        Admitted {
            #[pin]
            inner: F,
            headers: Pending,
        },
        /// Answered by the layer.
        Ready { response: Option<Response<RateLimitBody<B>>> },
        /// Decided or served later.
        Deferred { future: BoxFuture<B, E> },
    }
}

impl<F, B, E> ResponseFuture<F, B, E> {
    pub(crate) fn admitted(inner: F, headers: Pending) -> Self {
        Self {
            state: State::Admitted { inner, headers },
        }
    }

    pub(crate) fn ready(response: Response<RateLimitBody<B>>) -> Self {
        Self {
            state: State::Ready {
                response: Some(response),
            },
        }
    }

    pub(crate) fn deferred(future: BoxFuture<B, E>) -> Self {
        Self {
            state: State::Deferred { future },
        }
    }
}

impl<F, B, E> Future for ResponseFuture<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<RateLimitBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProjection::Admitted { inner, headers } => {
                let mut response = std::task::ready!(inner.poll(cx))?.map(RateLimitBody::inner);
                match headers {
                    Pending::None => {}
                    Pending::Made(made) => insert_made(made, response.headers_mut()),
                    Pending::Later(decision, style) => {
                        style.apply(decision, response.headers_mut());
                    }
                }
                Poll::Ready(Ok(response))
            }
            StateProjection::Ready { response } => match response.take() {
                Some(response) => Poll::Ready(Ok(response)),
                None => Poll::Pending,
            },
            StateProjection::Deferred { future } => future.as_mut().poll(cx),
        }
    }
}
