//go:build unix

package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"strconv"
	"text/tabwriter"

	"github.com/etcdsync/etcdsync"
	"github.com/spf13/cobra"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// newHoldersCmd is "lockctl holders".
func newHoldersCmd(conn *connFlags) *cobra.Command {
	var output string
	cmd := &cobra.Command{
		Use:   "holders [flags] NAME",
		Short: "List who holds NAME and who waits, in queue order",
		Long: `List the holders and waiters of NAME in queue order (create revision), with
each key's create revision, lease, the lease's TTL left in seconds (-1 when
it is gone) and value. It reads the keys once and each distinct lease once,
each read bounded by --dial-timeout.

Two queues can live on one name, each numbered from 1:
  exclusive  NAME/<id>: a Mutex or an Election (also etcdctl lock/elect);
             the oldest holds, the others wait
  semaphore  NAME/<id> whose values are all "<permits>/<capacity>": holders
             in order while their permits fit in the capacity
  read/write NAME/read/<id>, NAME/write/<id>: an RWMutex; a reader holds
             when no writer is older, a writer when it is the oldest
Keys of nested names (NAME/x/...) are not listed. A name nobody holds or
waits for prints the header only (table) or [] (json).`,
		Example: `  lockctl holders nightly-report
  lockctl holders -o json downloads | jq '.[] | select(.role == "waiter") | .key'`,
		Args: cobra.ArbitraryArgs,
		RunE: withCode(func(cmd *cobra.Command, args []string) error {
			if len(args) != 1 {
				return usage(fmt.Errorf("want NAME, got %d argument(s) (see '%s --help')", len(args), cmd.CommandPath()))
			}
			if output != "table" && output != "json" {
				return usage(fmt.Errorf("-o %q: want table or json", output))
			}
			if err := checkName(cmd, args[0]); err != nil {
				return err
			}
			return holders(conn, args[0], output, cmd.OutOrStdout())
		}),
	}
	cmd.Flags().StringVarP(&output, "output", "o", "table", "output format: table or json")
	return cmd
}

// entry is one key of a name's queues.
type entry struct {
	Position       int    `json:"position"` // in its queue, from 1
	Role           string `json:"role"`     // holder or waiter
	Kind           string `json:"kind"`     // exclusive, semaphore, read or write
	Key            string `json:"key"`
	CreateRevision int64  `json:"create_revision"`
	Lease          string `json:"lease"` // hex, "" for a key without a lease
	TTL            int64  `json:"ttl"`   // seconds left; -1 when the lease is gone or there is none
	Value          string `json:"value"`

	leaseID int64
}

// holders prints name's queues to out. It blocks for one read of the keys
// and one per distinct lease, each bounded by --dial-timeout.
func holders(cf *connFlags, name, output string, out io.Writer) error {
	prefix := name + "/"
	cli, err := cf.dial(context.Background(), prefix)
	if err != nil {
		return err
	}
	defer cli.Close()
	ctx, cancel := context.WithTimeout(context.Background(), cf.dialTimeout)
	found, err := etcdsync.Holders(ctx, cli, name)
	cancel()
	if err != nil {
		return err
	}
	entries := rows(found)
	ttls := map[int64]int64{0: -1}
	for i, e := range entries {
		lease := e.leaseID
		if _, ok := ttls[lease]; !ok {
			ctx, cancel := context.WithTimeout(context.Background(), cf.dialTimeout)
			ttl, err := cli.TimeToLive(ctx, clientv3.LeaseID(lease))
			cancel()
			if err != nil {
				return fmt.Errorf("read lease %x: %w", lease, err)
			}
			ttls[lease] = ttl.TTL
		}
		entries[i].TTL = ttls[lease]
	}
	if output == "json" {
		if entries == nil {
			entries = []entry{}
		}
		enc := json.NewEncoder(out)
		enc.SetIndent("", "  ")
		return enc.Encode(entries)
	}
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "POS\tROLE\tKIND\tKEY\tREV\tLEASE\tTTL\tVALUE")
	for _, e := range entries {
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%d\t%s\t%d\t%s\n", e.Position, e.Role, e.Kind, e.Key, e.CreateRevision, e.Lease, e.TTL, strconv.Quote(e.Value))
	}
	return tw.Flush()
}

// rows are the table's rows of es (etcdsync.Holders' entries), numbered
// from 1 in each queue: the direct children, then an RWMutex's keys.
func rows(es []etcdsync.Entry) []entry {
	var out []entry
	pos := map[bool]int{} // by "in the RWMutex's queue"
	for _, e := range es {
		rw := e.Kind == "read" || e.Kind == "write"
		pos[rw]++
		r := entry{Position: pos[rw], Role: "waiter", Kind: e.Kind, Key: e.Key, CreateRevision: e.Rev, Value: string(e.Value), TTL: -1}
		if e.Held {
			r.Role = "holder"
		}
		if e.Lease != clientv3.NoLease {
			r.Lease, r.leaseID = strconv.FormatInt(int64(e.Lease), 16), int64(e.Lease)
		}
		out = append(out, r)
	}
	return out
}
