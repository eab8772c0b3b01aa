//! The future a [`RateLimitService`](super::RateLimitService) returns.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use std::sync::Arc;

use http::Response;
use pin_project_lite::pin_project;

use super::layer::Config;
use crate::decision::Decision;

/// A boxed future, for the Redis tier whose decision itself must be awaited.
pub(crate) type BoxFuture<B, E> = Pin<Box<dyn Future<Output = Result<Response<B>, E>> + Send>>;

pin_project! {
    /// The response to a rate-limited request: the inner service's, with the rate-limit
    /// headers added, or the layer's own 429 (or 400).
    #[project = Projection]
    pub struct ResponseFuture<F, B, E> {
        #[pin]
        state: State<F, B, E>,
    }
}

pin_project! {
    #[project = StateProjection]
    enum State<F, B, E> {
        /// Admitted: the inner service's future, and the decision whose headers its
        /// response gets.
        Admitted {
            #[pin]
            inner: F,
            decision: Decision,
            config: Arc<Config>,
        },
        /// Answered by the layer.
        Ready { response: Option<Response<B>> },
        /// Decided and served later (the Redis tier).
        Deferred { future: BoxFuture<B, E> },
    }
}

impl<F, B, E> ResponseFuture<F, B, E> {
    pub(crate) fn admitted(inner: F, decision: Decision, config: Arc<Config>) -> Self {
        Self {
            state: State::Admitted {
                inner,
                decision,
                config,
            },
        }
    }

    pub(crate) fn ready(response: Response<B>) -> Self {
        Self {
            state: State::Ready {
                response: Some(response),
            },
        }
    }

    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
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
    type Output = Result<Response<B>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProjection::Admitted {
                inner,
                decision,
                config,
            } => {
                let mut response = std::task::ready!(inner.poll(cx))?;
                config.style.apply(decision, response.headers_mut());
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
