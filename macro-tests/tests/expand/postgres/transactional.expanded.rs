use idempotent::{PostgresStore, idempotent};
use sqlx::{Postgres, Transaction};
struct Debit {
    id: i64,
    amount: i64,
}
async fn debit(
    msg: &Debit,
    pg: &PostgresStore,
) -> ::core::result::Result<
    ::idempotent::Outcome<()>,
    ::idempotent::Error<sqlx::Error>,
> {
    #[allow(clippy::needless_borrow)]
    let __idempotent_key = {
        #[allow(unused_imports)]
        use ::idempotent::__private::{DisplayField as _, UncheckedField as _};
        if false {
            let (id,) = (&msg.id,);
            ::idempotent::__private::check_display(format_args!("debit:{0}", id));
        }
        let mut __idempotent_key = ::idempotent::__private::KeyBuilder::new("debit");
        __idempotent_key.text("debit:");
        (&::idempotent::__private::Shown(&msg.id)).put(&mut __idempotent_key, "id");
        __idempotent_key.finish()
    };
    let __idempotent_call = ::idempotent::__private::Call::new(
        ::idempotent::__private::Spec::new(
            ::core::time::Duration::from_millis(86400000u64),
            ::core::time::Duration::from_millis(30000u64),
            5u32,
        ),
        __idempotent_key,
    );
    let __idempotent_store = &(pg);
    let __idempotent_checked_store = __idempotent_store;
    ::idempotent::__private::require_transactional(__idempotent_checked_store);
    let __idempotent_store = {
        #[allow(unused_imports)]
        use ::idempotent::__private::{CheckedTxStore as _, UncheckedTxStore as _};
        ::idempotent::__private::TxStore(__idempotent_store).transactional_store()
    };
    let __idempotent_tx = ::idempotent::__private::TxSlot::for_store(__idempotent_store);
    ::idempotent::__private::run_transactional(
            __idempotent_call,
            __idempotent_store,
            &__idempotent_tx,
            ::idempotent::__private::classifier::<sqlx::Error>(),
            ::idempotent::__private::process_sink,
            async {
                let mut __idempotent_lent = __idempotent_tx.lend();
                let tx: &mut Transaction<'_, Postgres> = __idempotent_lent
                    .as_handler_tx::<Transaction<'_, Postgres>>();
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
                    let __idempotent_fake_return: Result<(), sqlx::Error> = loop {};
                    return __idempotent_fake_return;
                }
                sqlx::query("UPDATE accounts SET balance = balance - $1")
                    .bind(msg.amount)
                    .execute(&mut **tx)
                    .await?;
                Ok(())
            },
        )
        .await
}
