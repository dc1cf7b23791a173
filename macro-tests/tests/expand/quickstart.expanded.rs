//! The quickstart's handler (`examples/quickstart.rs`), whose expansion the crate docs
//! show; `expand.rs` checks that this file, the example and the docs agree.
use std::collections::HashMap;
use std::sync::{LazyLock, Mutex};
use std::time::Duration;
use idempotent::{Classify, idempotent};
struct OrderPlaced {
    order_id: u64,
    amount_cents: i64,
}
#[automatically_derived]
impl ::core::fmt::Debug for OrderPlaced {
    #[inline]
    fn fmt(&self, f: &mut ::core::fmt::Formatter) -> ::core::fmt::Result {
        ::core::fmt::Formatter::debug_struct_field2_finish(
            f,
            "OrderPlaced",
            "order_id",
            &self.order_id,
            "amount_cents",
            &&self.amount_cents,
        )
    }
}
#[automatically_derived]
impl ::core::clone::Clone for OrderPlaced {
    #[inline]
    fn clone(&self) -> OrderPlaced {
        OrderPlaced {
            order_id: ::core::clone::Clone::clone(&self.order_id),
            amount_cents: ::core::clone::Clone::clone(&self.amount_cents),
        }
    }
}
enum PayError {
    #[error("database timed out")]
    #[idempotent(retryable)]
    DbTimeout,
    #[error("insufficient funds")]
    #[idempotent(terminal)]
    InsufficientFunds,
}
#[automatically_derived]
impl ::core::fmt::Debug for PayError {
    #[inline]
    fn fmt(&self, f: &mut ::core::fmt::Formatter) -> ::core::fmt::Result {
        ::core::fmt::Formatter::write_str(
            f,
            match self {
                PayError::DbTimeout => "DbTimeout",
                PayError::InsufficientFunds => "InsufficientFunds",
            },
        )
    }
}
#[allow(unused_qualifications)]
#[automatically_derived]
impl ::thiserror::__private21::Error for PayError {}
#[allow(unused_qualifications)]
#[automatically_derived]
impl ::core::fmt::Display for PayError {
    fn fmt(&self, __formatter: &mut ::core::fmt::Formatter) -> ::core::fmt::Result {
        #[allow(unused_variables, deprecated, clippy::used_underscore_binding)]
        match self {
            PayError::DbTimeout {} => __formatter.write_str("database timed out"),
            PayError::InsufficientFunds {} => __formatter.write_str("insufficient funds"),
        }
    }
}
#[automatically_derived]
impl ::idempotent::Classify for PayError {
    fn class(&self) -> ::idempotent::ErrorClass {
        match self {
            Self::DbTimeout => ::idempotent::ErrorClass::Retryable,
            Self::InsufficientFunds => ::idempotent::ErrorClass::Terminal,
        }
    }
}
/// What the world saw: how many times each order was charged.
static CHARGES: LazyLock<Mutex<HashMap<u64, u32>>> = LazyLock::new(Default::default);
/// How many times each order's handler body started.
static STARTS: LazyLock<Mutex<HashMap<u64, u32>>> = LazyLock::new(Default::default);
async fn charge(
    msg: OrderPlaced,
) -> ::core::result::Result<::idempotent::Outcome<u64>, ::idempotent::Error<PayError>> {
    #[allow(clippy::needless_borrow)]
    let __idempotent_key = {
        #[allow(unused_imports)]
        use ::idempotent::__private::{DisplayField as _, UncheckedField as _};
        if false {
            let (order_id,) = (&msg.order_id,);
            ::idempotent::__private::check_display(format_args!("order:{0}", order_id));
        }
        let mut __idempotent_key = ::idempotent::__private::KeyBuilder::new("charge");
        __idempotent_key.text("order:");
        (&::idempotent::__private::Shown(&msg.order_id))
            .put(&mut __idempotent_key, "order_id");
        __idempotent_key.finish()
    };
    let __idempotent_call = ::idempotent::__private::Call::new(
        ::idempotent::__private::Spec::new(
            ::core::time::Duration::from_millis(600000u64),
            ::core::time::Duration::from_millis(5000u64),
            3u32,
        ),
        __idempotent_key,
    );
    let __idempotent_store = &::idempotent::__private::DefaultStore;
    ::idempotent::__private::run(
            __idempotent_call,
            __idempotent_store,
            ::idempotent::__private::classifier::<PayError>(),
            ::idempotent::__private::process_sink,
            async {
                #[allow(
                    unknown_lints,
                    unreachable_code,
                    clippy::diverging_sub_expression,
                    clippy::let_unit_value,
                    clippy::unreachable,
                    clippy::empty_loop,
                    clippy::needless_return
                )]
                if false {
                    let __idempotent_fake_return: Result<u64, PayError> = loop {};
                    return __idempotent_fake_return;
                }
                let start = {
                    let mut starts = STARTS.lock().unwrap();
                    let n = starts.entry(msg.order_id).or_default();
                    *n += 1;
                    *n
                };
                match (msg.order_id, start) {
                    (3, 1) => return Err(PayError::DbTimeout),
                    (4, 1) => tokio::time::sleep(Duration::from_secs(60)).await,
                    (6, _) => return Err(PayError::DbTimeout),
                    _ => {}
                }
                if msg.amount_cents > 10_000 {
                    return Err(PayError::InsufficientFunds);
                }
                *CHARGES.lock().unwrap().entry(msg.order_id).or_default() += 1;
                Ok(msg.order_id)
            },
        )
        .await
}
