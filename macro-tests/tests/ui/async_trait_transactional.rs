use idempotent::{Error, Outcome, PostgresStore, async_trait, idempotent};

#[derive(Debug, thiserror::Error, idempotent::Classify)]
#[idempotent(retryable)]
#[error(transparent)]
struct Db(#[from] sqlx::Error);

struct Order {
    order_id: u64,
}

#[async_trait]
trait Handler {
    async fn handle(&self, msg: &Order) -> Result<Outcome<()>, Error<Db>>;
}

struct Billing {
    store: PostgresStore,
}

#[async_trait]
impl Handler for Billing {
    // The transaction argument would leave the signature, which must stay the trait's.
    #[idempotent(key = "order:{order_id}", store = self.store, namespace = "billing", transactional)]
    async fn handle(
        &self,
        msg: &Order,
        tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    ) -> Result<(), Db> {
        let _ = (msg.order_id, tx);
        Ok(())
    }
}

fn main() {}
