//! The quota module's error type.

use std::fmt;
use std::time::Duration;

use thiserror::Error;

use crate::error_kind::ErrorKind;
use crate::quota::model::ProviderId;
use crate::repo::error::RepoError;
use crate::repo::names::shown;
use crate::server::clock::ClockError;
use crate::txn::error::TxnError;

/// One provider's refusal inside [`QuotaError::QuotaExceeded`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Refusal {
    /// The provider that refused.
    pub provider: ProviderId,
    /// What the request needed from it (several claims under one ancestor add up).
    pub requested: i64,
    /// What it had left (negative when its limit was lowered below its usage).
    pub available: i64,
    /// Its limit.
    pub limit: i64,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (requested {}, available {}, limit {})",
            self.provider, self.requested, self.available, self.limit
        )
    }
}

fn list(refusals: &[Refusal]) -> String {
    refusals
        .iter()
        .map(Refusal::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// Everything a quota operation can fail with. Input errors are found before anything is written.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum QuotaError {
    /// Not enough quota on at least one provider; nothing was taken from any of them.
    #[error("quota exceeded for consumer {consumer}, request {request}: {}", list(.refusals))]
    QuotaExceeded {
        /// The consumer.
        consumer: String,
        /// The request id.
        request: String,
        /// Every provider that refused.
        refusals: Vec<Refusal>,
    },
    /// No such provider (or one of a claim's ancestors is missing).
    #[error("{collection}/{provider}: no such quota provider", collection = crate::collections::PROVIDERS_COLLECTION)]
    UnknownProvider {
        /// The provider named.
        provider: ProviderId,
    },
    /// The provider already exists.
    #[error("{collection}/{provider}: the quota provider already exists", collection = crate::collections::PROVIDERS_COLLECTION)]
    ProviderExists {
        /// The provider named.
        provider: ProviderId,
    },
    /// An amount was zero or negative (amounts are whole units, so sums stay exact), or claims
    /// under one ancestor add up past `i64::MAX`.
    #[error("{collection}/{provider}: amount {amount} is not a positive whole number, or adds up past i64::MAX", collection = crate::collections::PROVIDERS_COLLECTION)]
    InvalidAmount {
        /// The provider it was asked of.
        provider: ProviderId,
        /// The amount given.
        amount: i64,
    },
    /// One call named the same provider twice; combine the amounts.
    #[error("{collection}/{provider} appears twice in one request; combine the amounts", collection = crate::collections::PROVIDERS_COLLECTION)]
    DuplicateProvider {
        /// The provider.
        provider: ProviderId,
    },
    /// A limit below zero.
    #[error("{collection}/{provider}: limit {limit} is negative", collection = crate::collections::PROVIDERS_COLLECTION)]
    NegativeLimit {
        /// The provider.
        provider: ProviderId,
        /// The limit given.
        limit: i64,
    },
    /// A request is unusable as a whole: it names no provider, or a provider is its own parent.
    /// (A bad name is [`QuotaError::InvalidName`].)
    #[error("{collection}: invalid quota request: {reason}", collection = crate::collections::PROVIDERS_COLLECTION)]
    InvalidRequest {
        /// What is wrong.
        reason: String,
    },
    /// A name is unusable: a provider's scope or resource, a consumer or a request id that is
    /// empty, longer than 512 bytes, or holds a control character (a NUL, a newline...). Names
    /// are stored in every provider they touch and shown in errors and logs, so they must stay
    /// short and printable.
    #[error("{collection}: {what} {} is unusable: {reason}", shown(.name), collection = crate::collections::PROVIDERS_COLLECTION)]
    InvalidName {
        /// Which name: `provider scope`, `provider resource`, `consumer` or `request id`.
        what: &'static str,
        /// The name given.
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A [`QuotaOptions`](crate::quota::QuotaOptions) value makes no sense (a zero or absurdly
    /// long duration, a backoff of zero or longer than the budget). Found before the quota
    /// collection is opened, so nothing is created.
    #[error("{collection}: option {option} = {value} is unusable: {reason}", collection = crate::collections::PROVIDERS_COLLECTION)]
    InvalidOption {
        /// The option, as named on `QuotaOptions` (`retry.max_wait` for a part of `retry`).
        option: &'static str,
        /// The value given.
        value: String,
        /// What it must be.
        reason: String,
    },
    /// The request id was already used by this consumer for different amounts or providers, or
    /// for a reservation where a consume is asked (or the reverse).
    #[error("{collection}: consumer {consumer}: request {request} was already used for something else", collection = crate::collections::PROVIDERS_COLLECTION)]
    RequestReused {
        /// The consumer.
        consumer: String,
        /// The request id.
        request: String,
    },
    /// The consumer holds nothing (never consumed, or already released).
    #[error("{collection}: consumer {consumer} holds no quota", collection = crate::collections::PROVIDERS_COLLECTION)]
    UnknownConsumer {
        /// The consumer.
        consumer: String,
    },
    /// The consumer holds nothing under this request (never consumed, or already released).
    #[error("{collection}: consumer {consumer} holds nothing under request {request}", collection = crate::collections::PROVIDERS_COLLECTION)]
    UnknownRequest {
        /// The consumer.
        consumer: String,
        /// The request id.
        request: String,
    },
    /// No such reservation: never made, already cancelled, or confirmed (for `cancel`).
    #[error("{collection}: consumer {consumer}: no reservation under request {request}", collection = crate::collections::PROVIDERS_COLLECTION)]
    UnknownReservation {
        /// The consumer.
        consumer: String,
        /// The request id.
        request: String,
    },
    /// The reservation expired (it is returned, or will be, by the GC); nothing was changed.
    #[error("{collection}: consumer {consumer}: reservation {request} expired at {expired_at}", collection = crate::collections::PROVIDERS_COLLECTION)]
    ReservationExpired {
        /// The consumer.
        consumer: String,
        /// The request id.
        request: String,
        /// Its expiry (server time).
        expired_at: chrono::DateTime<chrono::Utc>,
    },
    /// A reservation's time to live must be from 1 ms (expiries are kept in whole milliseconds)
    /// to one day.
    #[error("{collection}: reservation of request {request} of consumer {consumer}: ttl {ttl:?} must be from 1 ms to one day", collection = crate::collections::PROVIDERS_COLLECTION)]
    InvalidTtl {
        /// The consumer.
        consumer: String,
        /// The request id.
        request: String,
        /// The ttl given.
        ttl: Duration,
    },
    /// The generation-checked path kept finding its providers changed by others until the
    /// retry budget ran out. Retrying later is safe.
    #[error("{what}: providers kept changing for {elapsed:?} ({attempts} attempts); last: {last}")]
    Contended {
        /// The operation.
        what: String,
        /// Attempts made.
        attempts: u32,
        /// Time spent.
        elapsed: Duration,
        /// The last reason to retry.
        last: String,
    },
    /// A provider document could not be read or written.
    #[error("quota: {source}")]
    Document {
        /// What the repository said.
        #[source]
        source: Box<RepoError>,
    },
    /// The transaction spanning several providers failed.
    #[error("quota: {source}")]
    Transaction {
        /// What the transaction said.
        #[source]
        source: Box<TxnError>,
    },
    /// The server's time could not be read.
    #[error("quota: {source}")]
    Clock {
        /// What reading the server's clock said.
        #[source]
        source: ClockError,
    },
    /// A provider is of a stored format this version does not read (see `mongotx::format`);
    /// nothing was written.
    #[error(transparent)]
    Format(#[from] crate::repo::format::FormatError),
    /// A fault injector stopped the operation here, as a crash would (only with the `testkit`
    /// feature).
    #[cfg(feature = "testkit")]
    #[error("injected crash at {at}")]
    Crashed {
        /// The failpoint.
        at: crate::txn::failpoint::Failpoint,
    },
}

crate::txn::error::from_lower_errors!(QuotaError);

impl QuotaError {
    /// What kind of failure this is (see [`ErrorKind`]).
    pub fn kind(&self) -> ErrorKind {
        use QuotaError as E;
        match self {
            E::QuotaExceeded { .. } | E::ReservationExpired { .. } => ErrorKind::Refused,
            E::UnknownProvider { .. }
            | E::UnknownConsumer { .. }
            | E::UnknownRequest { .. }
            | E::UnknownReservation { .. } => ErrorKind::NotFound,
            E::ProviderExists { .. } => ErrorKind::AlreadyExists,
            E::InvalidAmount { .. }
            | E::DuplicateProvider { .. }
            | E::NegativeLimit { .. }
            | E::InvalidRequest { .. }
            | E::InvalidName { .. }
            | E::InvalidOption { .. }
            | E::RequestReused { .. }
            | E::InvalidTtl { .. } => ErrorKind::InvalidInput,
            E::Contended { .. } => ErrorKind::Conflict,
            E::Document { source } => source.kind(),
            E::Transaction { source } => source.kind(),
            E::Clock { source } => source.kind(),
            E::Format(source) => source.kind(),
            #[cfg(feature = "testkit")]
            E::Crashed { .. } => ErrorKind::Crashed,
        }
    }

    /// Why the quota refused the call, for its refusals counter (`crate::metrics`): the state
    /// of the quota, not the call's input or an outage.
    pub(crate) fn refusal_reason(&self) -> Option<&'static str> {
        match self {
            QuotaError::QuotaExceeded { .. } => Some("exceeded"),
            QuotaError::ReservationExpired { .. } => Some("expired"),
            QuotaError::Contended { .. } => Some("contended"),
            _ => None,
        }
    }

    /// Whether trying the same call again may succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            QuotaError::Contended { .. } => true,
            QuotaError::Document { source } => source.is_retryable(),
            QuotaError::Transaction { source } => source.is_retryable(),
            QuotaError::Clock { source } => source.is_retryable(),
            QuotaError::Format(source) => source.is_retryable(),
            _ => false,
        }
    }
}
