//! Live stream migration on the client side: a `Generate` stream that the server moves to a peer
//! (`MigrateStreams`, or a drain with `--drain-to`) ends there with a `migrated` event; the
//! [`GenerateStream`] follows it to the target with a connection of the same kind (the client's
//! [`Connector`], token and deadlines) and resumes it by its token, as one stream.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use futures_core::Stream;
use tonic::transport::Channel;
use tonic::Status;

use crate::client::Client;
use crate::proto::{self, generate_response::Event};

/// Servers a [`GenerateStream`] follows one stream through at most (`migrated` events); one more
/// move ends it with ABORTED.
pub const MAX_MIGRATION_HOPS: usize = 16;

type ConnectFuture = Pin<Box<dyn Future<Output = Result<Channel, tonic::transport::Error>> + Send>>;
type OpenFuture = Pin<Box<dyn Future<Output = Result<tonic::Streaming<proto::GenerateResponse>, Status>> + Send>>;

/// How a client opens a channel to another server (`host:port`) when a stream moves there.
/// [`Client::connect`] sets one (the same scheme and connect settings); a client made with
/// [`Client::from_channel`] (TLS, interceptors) needs [`Client::with_connector`] to follow moves.
#[derive(Clone)]
pub struct Connector(Arc<dyn Fn(String) -> ConnectFuture + Send + Sync>);

impl Connector {
    /// A connector from an async function of the target (`host:port`) to a connected channel.
    pub fn new<F, Fut>(f: F) -> Self
    where
        F: Fn(String) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Channel, tonic::transport::Error>> + Send + 'static,
    {
        Connector(Arc::new(move |t| Box::pin(f(t))))
    }

    pub(crate) fn open(&self, target: String) -> ConnectFuture {
        (self.0)(target)
    }
}

impl std::fmt::Debug for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Connector(..)")
    }
}

enum State {
    Streaming(tonic::Streaming<proto::GenerateResponse>),
    Opening(OpenFuture),
    Done,
}

/// The stream of a `Generate` call: `started`, one `token` per generated token, `finished`.
/// Dropping it cancels the call, which stops the server's loop and frees its cache.
///
/// A stream moved to another server is followed there (unless the client was made with
/// `with_follow_migrations(false)`, which passes the `migrated` event on): the `migrated` event
/// and the resumed call's `started` event are not yielded, and the tokens go on with no duplicate
/// and no gap. [`GenerateStream::migrations`] lists the servers it moved to.
pub struct GenerateStream {
    state: State,
    /// The client that started the stream and the request's model, when following moves.
    follow: Option<(Client, String)>,
    migrations: Vec<String>,
}

impl GenerateStream {
    pub(crate) fn new(call: tonic::Streaming<proto::GenerateResponse>, follow: Option<(Client, String)>) -> Self {
        GenerateStream { state: State::Streaming(call), follow, migrations: Vec::new() }
    }

    /// The servers (`host:port`) the stream moved to and was followed to, in order.
    pub fn migrations(&self) -> &[String] {
        &self.migrations
    }

    /// The next event (None at the end of the stream), like `tonic::Streaming::message`.
    pub async fn message(&mut self) -> Result<Option<proto::GenerateResponse>, Status> {
        match std::future::poll_fn(|cx| Pin::new(&mut *self).poll_next(cx)).await {
            None => Ok(None),
            Some(r) => r.map(Some),
        }
    }
}

impl futures_core::Stream for GenerateStream {
    type Item = Result<proto::GenerateResponse, Status>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            match &mut this.state {
                State::Done => return Poll::Ready(None),
                State::Opening(f) => match ready!(f.as_mut().poll(cx)) {
                    Ok(call) => this.state = State::Streaming(call),
                    Err(e) => {
                        this.state = State::Done;
                        return Poll::Ready(Some(Err(e)));
                    }
                },
                State::Streaming(call) => {
                    let msg = match ready!(Pin::new(call).poll_next(cx)) {
                        None => {
                            this.state = State::Done;
                            return Poll::Ready(None);
                        }
                        Some(Err(e)) => {
                            this.state = State::Done;
                            return Poll::Ready(Some(Err(e)));
                        }
                        Some(Ok(m)) => m,
                    };
                    let Some((client, model_id)) = &this.follow else { return Poll::Ready(Some(Ok(msg))) };
                    match &msg.event {
                        Some(Event::Migrated(moved)) => {
                            if this.migrations.len() >= MAX_MIGRATION_HOPS {
                                this.state = State::Done;
                                return Poll::Ready(Some(Err(Status::aborted(format!(
                                    "the stream moved more than {MAX_MIGRATION_HOPS} times"
                                )))));
                            }
                            this.migrations.push(moved.target.clone());
                            let (client, model_id, moved) = (client.clone(), model_id.clone(), moved.clone());
                            // replacing the call drops it: this server's end of the stream is cancelled
                            this.state = State::Opening(Box::pin(async move { client.resume_moved(&moved, model_id).await }));
                        }
                        // the resumed call's start: the caller saw the first one
                        Some(Event::Started(_)) if !this.migrations.is_empty() => {}
                        _ => return Poll::Ready(Some(Ok(msg))),
                    }
                }
            }
        }
    }
}
