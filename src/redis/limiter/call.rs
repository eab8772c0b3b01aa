//! One call to Redis and what it teaches the breaker: the timeout as a deadline, the
//! errors classified, the probe that closes the breaker again.

use super::*;

impl RedisLimiter {
    /// [`RedisError::CircuitOpen`] while the breaker rejects calls (checked before one
    /// is sent).
    pub(super) fn through_breaker(&self) -> Result<(), RedisError> {
        let inner = &*self.inner;
        match inner.breaker.gate(|| inner.monotonic.now_ns()) {
            Gate::Reject(ns) => Err(RedisError::CircuitOpen {
                retry_in: Duration::from_nanos(ns),
            }),
            _ => Ok(()),
        }
    }

    /// Redis answered a call: the breaker closes, and the end of an outage is logged once.
    pub(super) fn answered(&self) {
        let inner = &*self.inner;
        if inner.breaker.succeeded() {
            crate::redis::observe::redis_breaker(&inner.name, BreakerState::Closed);
        }
        self.recovered();
    }

    /// A call (the background probe's, if `probe`) failed with `e`: counted, logged, and
    /// told to the breaker. If that opens it, the background probe starts.
    pub(super) fn failed(&self, e: &RedisError, probe: bool) {
        let inner = &*self.inner;
        inner.errors.fetch_add(1, Ordering::Relaxed);
        crate::redis::observe::redis_error(&inner.name, e);
        let first = !inner.failing.swap(true, Ordering::Relaxed);
        crate::redis::observe::redis_health(&inner.name, Some(e), first);
        if !e.is_outage() {
            // Redis answered (with an error about this call): it is up.
            if inner.breaker.succeeded() {
                crate::redis::observe::redis_breaker(&inner.name, BreakerState::Closed);
            }
            return;
        }
        if inner.breaker.failed(inner.monotonic.now_ns(), probe) {
            crate::redis::observe::redis_breaker(&inner.name, BreakerState::Open);
            tokio::spawn(probe_while_open(Arc::downgrade(&self.inner)));
        }
    }

    /// One probe of an open breaker: a call of cost 0 (it writes nothing) on a key of its
    /// own. A connection that broke while Redis was away may answer its first request at
    /// once with the old error, and reconnect: then the probe tries once more, through
    /// the reconnected connection, within the same deadline.
    pub(super) async fn probe(&self) {
        let inner = &*self.inner;
        let deadline = tokio::time::Instant::now() + inner.timeout;
        let rule = inner.current.read().rule;
        let script_now = inner.clock.as_ref().map(|_| inner.now_us());
        let call = || {
            inner.calls.fetch_add(1, Ordering::Relaxed);
            self.call(PROBE_KEY, Op::Check(0), rule, &[], script_now, deadline)
        };
        let mut outcome = call().await;
        if matches!(outcome, Err(RedisError::Unavailable(_)))
            && tokio::time::Instant::now() < deadline
        {
            outcome = call().await;
        }
        match &outcome {
            Ok(_) => self.answered(),
            Err(e) => self.failed(e, true),
        }
    }

    /// Logs the end of an outage, once.
    pub(super) fn recovered(&self) {
        let inner = &*self.inner;
        if inner.failing.load(Ordering::Relaxed) && inner.failing.swap(false, Ordering::Relaxed) {
            crate::redis::observe::redis_health(&inner.name, None, true);
        }
    }

    /// One script call for a request of cost `n` under `rule` and the `also` quotas,
    /// with the script's time (µs) or none (the server's `TIME`), failing with
    /// [`RedisError::Timeout`] at `deadline`. With the penalty box, the key's box goes
    /// last among the keys and the penalty last among the arguments, and the answer
    /// says when the key is blocked.
    pub(super) async fn call(
        &self,
        key: &str,
        op: Op,
        rule: ScriptQuota,
        also: &[Also],
        now_us: Option<u64>,
        deadline: tokio::time::Instant,
    ) -> Result<Answer, RedisError> {
        let inner = &*self.inner;
        let redis_key = self.redis_key(key);
        // Empty, with no allocation, for one quota and no box.
        let mut also_keys: Vec<Vec<u8>> = also
            .iter()
            .map(|a| self.state_key(&a.prefix, key))
            .collect();
        if let Some(penalty) = &inner.penalty {
            also_keys.push(self.state_key(&penalty.prefix, key));
        }
        let call = |eval: bool| {
            let mut cmd = script_call(eval, inner.source, &inner.script, &redis_key, &also_keys);
            rule.push_args(&mut cmd, || inner.script_time());
            match op {
                Op::Check(n) => cmd.arg(n),
                Op::Refund(n) => cmd.arg(format!("r{n}")),
            };
            // The token bucket takes an absent `now`, which is cheapest.
            let absent = matches!(rule, ScriptQuota::TokenBucket { .. });
            now_and_also(&mut cmd, now_us, absent, also, || inner.script_time());
            if let Some(penalty) = &inner.penalty {
                cmd.arg(&penalty.arg);
            }
            cmd
        };
        let mut connection = inner.connection.get();
        let rules = || std::iter::once(rule).chain(also.iter().map(|a| a.rule));
        let decided = |decision: Result<Decision, RedisError>| {
            decision.map(|decision| Answer {
                decision,
                block_us: None,
            })
        };
        let blocked = |us| {
            Ok(Answer {
                decision: blocked_decision(rule, us),
                block_us: Some(us),
            })
        };
        let run = async {
            match (rule, op) {
                (ScriptQuota::TokenBucket { t, tau, burst }, Op::Check(n)) if also.is_empty() => {
                    eval::<Boxed<i64>>(&mut connection, call)
                        .await
                        .map(|reply| match reply {
                            Boxed::Decided(reply) => {
                                decided(gcra_decision(reply, t, tau, burst, n))
                            }
                            Boxed::Blocked(us) => blocked(us),
                        })
                }
                (_, Op::Check(n)) => {
                    eval::<Boxed<Vec<i64>>>(&mut connection, call)
                        .await
                        .map(|reply| match reply {
                            Boxed::Decided(replies) => decided(all_of(&replies, rules(), n)),
                            Boxed::Blocked(us) => blocked(us),
                        })
                }
                (_, Op::Refund(_)) => eval::<Vec<i64>>(&mut connection, call)
                    .await
                    .map(|replies| decided(settled(&replies, rules()))),
            }
        };
        self.bounded(deadline, &redis_key, run).await?
    }

    /// Runs `call` (a script call about `redis_key`) until `deadline`: one timer bounds
    /// the whole call, reconnection, retries and redirections included. Its error is
    /// classified, and an unavailable server or a timeout marks the connection failed.
    ///
    /// A plain function that maps the timer's future, not an `async fn`: the latter would
    /// hold `call` twice (as its argument and inside the timer), and a check's future,
    /// which moves as a whole, would be half a kilobyte larger.
    pub(super) fn bounded<'a, T>(
        &'a self,
        deadline: tokio::time::Instant,
        redis_key: &'a [u8],
        call: impl std::future::Future<Output = redis::RedisResult<T>> + 'a,
    ) -> impl std::future::Future<Output = Result<T, RedisError>> + 'a {
        use futures_util::FutureExt as _;
        tokio::time::timeout_at(deadline, call).map(move |outcome| self.timed(outcome, redis_key))
    }

    /// What [`bounded`](Self::bounded) returns for the `outcome` of its timer.
    pub(super) fn timed<T>(
        &self,
        outcome: Result<redis::RedisResult<T>, tokio::time::error::Elapsed>,
        redis_key: &[u8],
    ) -> Result<T, RedisError> {
        let inner = &*self.inner;
        match outcome {
            Ok(Ok(reply)) => Ok(reply),
            Ok(Err(e)) => {
                let e = self.classify(e, redis_key);
                if matches!(e, RedisError::Unavailable(_)) {
                    inner.connection.failed();
                }
                Err(e)
            }
            Err(_) => {
                inner.connection.failed();
                Err(RedisError::Timeout(inner.timeout))
            }
        }
    }

    pub(super) fn classify(&self, e: redis::RedisError, key: &[u8]) -> RedisError {
        if e.is_timeout() {
            RedisError::Timeout(self.inner.timeout)
        } else {
            RedisError::from_redis(e, key)
        }
    }
}
