//! A gRPC greeter written without code generation (so no `protoc` is needed): the
//! messages derive `prost::Message`, and the service routes one unary method through
//! `tonic::server::Grpc`, as tonic's generated code does. Shared by the tonic example and
//! the tonic tests.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tonic::body::Body;
use tonic::server::{NamedService, UnaryService};
use tonic::{Request, Response, Status};

/// `helloworld.HelloRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HelloRequest {
    /// Who to greet.
    #[prost(string, tag = "1")]
    pub name: String,
}

/// `helloworld.HelloReply`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HelloReply {
    /// The greeting.
    #[prost(string, tag = "1")]
    pub message: String,
}

/// The method's path.
pub const SAY_HELLO: &str = "/helloworld.Greeter/SayHello";

/// The greeter service: answers `SayHello`, and `UNIMPLEMENTED` to anything else.
#[derive(Clone, Debug, Default)]
pub struct Greeter;

impl NamedService for Greeter {
    const NAME: &'static str = "helloworld.Greeter";
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// The `SayHello` method.
struct SayHello;

impl UnaryService<HelloRequest> for SayHello {
    type Response = HelloReply;
    type Future = BoxFuture<Result<Response<HelloReply>, Status>>;

    fn call(&mut self, request: Request<HelloRequest>) -> Self::Future {
        Box::pin(async move {
            let name = request.into_inner().name;
            Ok(Response::new(HelloReply {
                message: format!("Hello, {name}!"),
            }))
        })
    }
}

impl<B> tower::Service<http::Request<B>> for Greeter
where
    B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>> + Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        if req.uri().path() == SAY_HELLO {
            Box::pin(async move {
                let mut grpc = tonic::server::Grpc::new(tonic_prost::ProstCodec::default());
                Ok(grpc.unary(SayHello, req).await)
            })
        } else {
            Box::pin(async { Ok(Status::unimplemented("no such method").into_http()) })
        }
    }
}

/// Calls `SayHello` on `channel`.
pub async fn say_hello(
    channel: tonic::transport::Channel,
    name: &str,
) -> Result<Response<HelloReply>, Status> {
    let mut client = tonic::client::Grpc::new(channel);
    client
        .ready()
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
    client
        .unary(
            Request::new(HelloRequest {
                name: name.to_owned(),
            }),
            http::uri::PathAndQuery::from_static(SAY_HELLO),
            tonic_prost::ProstCodec::default(),
        )
        .await
}
